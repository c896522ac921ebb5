"""The RL loop the coordinator runs for one job: generate, reward, advantages, train, sync, eval.

It talks to workers only through `clients` adapters and reports everything it does through an
`emit(kind, step, data)` callback, which the job manager persists and streams to watchers. The
loop owns no gRPC, files or threads beyond fanning calls out to several engines at once.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from services import rpc
from services.api import rollout_pb2, trainer_pb2
from services.coordinator.clients import (Completion, Pending, PeerError, RolloutClient, TrainerClient, TrainerGroup,
                                          wait_all)
from services.coordinator.config import JobConfig, OptimizerConfig, SamplingConfig, SchedulerConfig
from services.coordinator.datasets import Example, PromptSampler, load_examples, open_dataset
from services.coordinator.pipeline import AsyncSteps, Rollout, select_groups
from services.coordinator.rewards import build_reward, score_all
from services.coordinator.weight_sync import WeightSyncer
from services.models.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import torch

log = rpc.get_logger("coordinator")
CRITIC_DIR = "critic"  # a PPO checkpoint's critic: a folder inside the policy's checkpoint folder
Emit = Callable[[str, int, dict], None]


class JobCancelled(RuntimeError):
    pass


@dataclass(frozen=True)
class Resume:
    """Run a job on from its checkpoint of `step` (at `path`): the trainers load it, the data order
    and sampling seeds are replayed up to it, and the steps after it run as they would have."""

    step: int
    path: str
    evals_before: dict[str, float | None]
    # How far the steps up to it went into the data and the sampling seeds (their step metrics
    # batches_dealt and seeds_drawn); None for a job whose steps did not record them (one batch and
    # one seed a step are replayed then).
    batches_dealt: int | None = None
    seeds_drawn: int | None = None


class WeightSyncFailed(RuntimeError):
    pass


@dataclass
class Fleet:
    """The workers a job runs on, as the coordinator reaches them."""

    trainers: list[TrainerClient]
    engines: list[RolloutClient]
    critics: list[TrainerClient] = field(default_factory=list)  # PPO's value model, when the job has one
    trainer_token: str = ""
    in_pool: set[int] = field(default_factory=set)
    # Where engine k runs now, when that can change (a Kubernetes pod that restarted has a new
    # address): a client for its current address, or None while it is not ready.
    relocate: Callable[[int], RolloutClient | None] | None = None
    # An elastic job's view of the rollout engines ready now (addresses in rank order), and how
    # to reach one: engines new to it are admitted between steps (`RLLoop.admit_engines`).
    discover: Callable[[], list[str]] | None = None
    connect: Callable[[str], RolloutClient] | None = None
    retired: set[int] = field(default_factory=set)  # engines discovery no longer lists: no weights, no work

    @property
    def trainer_servers(self) -> list[TrainerClient]:
        """Every trainer server the job uses: the policy's ranks, then the critics."""
        return [*self.trainers, *self.critics]


def _optimizer(opt: OptimizerConfig) -> trainer_pb2.OptimizerConfig:
    return trainer_pb2.OptimizerConfig(lr=opt.lr, weight_decay=opt.weight_decay, beta1=opt.betas[0],
                                       beta2=opt.betas[1], eps=opt.eps, grad_clip=opt.grad_clip)


def _scheduler(sched: SchedulerConfig, num_rollout: int) -> trainer_pb2.SchedulerConfig:
    return trainer_pb2.SchedulerConfig(kind=sched.kind, warmup_steps=sched.warmup_steps,
                                       decay_steps=sched.total_decay_steps(num_rollout), min_lr_ratio=sched.min_lr_ratio)


def trainer_config(job: JobConfig) -> trainer_pb2.TrainerConfig:
    t, a = job.trainer, job.algorithm
    return trainer_pb2.TrainerConfig(
        model_path=str(job.model),
        backend=t.backend,
        device=t.device,
        dtype=t.dtype,
        seed=job.seed,
        optimizer=_optimizer(t.optimizer),
        scheduler=_scheduler(t.scheduler, job.num_rollout),
        loss=trainer_pb2.LossConfig(
            clip_eps_low=a.clip_eps_low,
            clip_eps_high=a.clip_eps_high,
            kl_coef=a.kl_coef if a.use_kl_loss else 0.0,  # in the reward instead: see rl_step
            kl_estimator=a.kl_estimator,
            entropy_coef=a.entropy_coef,
            loss_agg=a.loss_agg,
            # (the synchronous loop, max_staleness 0, trains on-policy: no correction)
            correction=a.async_.correction if a.max_staleness > 0 else "none",
            is_cap=a.async_.tis_cap if a.max_staleness > 0 else 0.0,
        ),
        tags=job.trainer_tags,
        eval_only=job.eval_only,
        offload=t.offload,
        colocate=t.colocate,
        micro_batch_size=t.micro_batch_size,
        bucket_bytes=job.weight_sync.bucket_bytes,
        master_weights=t.master_weights or "",
        tensor_parallel=t.tensor_parallel,
        pipeline_parallel=t.pipeline_parallel,
        compile=t.compile,
    )


def critic_config(job: JobConfig) -> trainer_pb2.TrainerConfig:
    """The TrainerConfig of a critic rank: the policy's architecture with a value head, on the
    torch backend, with the critic's own optimizer and schedule (and the trainer's placement
    where the critic section leaves it open)."""
    t, c = job.trainer, job.critic
    config = trainer_config(job)
    config.role = "critic"
    config.backend = "torch"
    config.model_path = str(c.model or job.model)
    config.device = c.device or t.device
    config.dtype = c.dtype or t.dtype
    config.micro_batch_size = c.micro_batch_size or t.micro_batch_size
    config.offload = job.critic_offload
    config.ClearField("tags")
    config.master_weights = ""
    config.tensor_parallel = config.pipeline_parallel = 1
    config.optimizer.CopyFrom(_optimizer(c.optimizer))
    config.scheduler.CopyFrom(_scheduler(c.scheduler, job.num_rollout))
    config.loss.CopyFrom(trainer_pb2.LossConfig(value_clip=c.value_clip, loss_agg=job.algorithm.loss_agg))
    return config


def sampling_params(cfg, *, n: int = 1, seed: int | None = None) -> rollout_pb2.SamplingParams:
    params = rollout_pb2.SamplingParams(
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_new_tokens=cfg.max_new_tokens,
        stop=list(cfg.stop),
        n=n,
    )
    if seed is not None:
        params.seed = seed
    return params


class RLLoop:
    def __init__(self, job: JobConfig, fleet: Fleet, emit: Emit, cancelled: threading.Event | None = None,
                 resume: Resume | None = None):
        self.job = job
        self.resume = resume
        self.fleet = fleet
        self.emit = _serialized(emit)  # (the producer and an eval beside training emit too)
        self.cancelled = cancelled or threading.Event()
        self.weights_version = -1
        self._pool = ThreadPoolExecutor(max_workers=2 + 2 * len(fleet.engines))
        self._fanout = rpc.FanOut("engine-calls")  # every engine's Generate and UpdateWeights, on one thread
        self.syncer: WeightSyncer | None = None
        self.trainers = TrainerGroup(fleet.trainers) if fleet.trainers else None
        self.critics: TrainerGroup | None = None  # PPO's value model (setup builds it; never in eval-only)
        self._eval_sets = [
            (ds, load_examples(ds.path, job.data.columns, limit=ds.limit),
             build_reward(ds.reward, fleet.trainer_token or None))
            for ds in job.eval.datasets
        ]
        # Conversations become prompt text here, with the model's chat template (its tokenizer files).
        self._chat = load_tokenizer(job.model) if job.data.messages_key is not None else None
        self._tokenizer = load_tokenizer(job.model) if job.agent is not None else None  # episodes are token ids
        self._remote_envs = None  # an agent job's environment server, reached once
        self._rng = random.Random(job.seed)  # every sampling seed (run() starts it afresh)
        self._seeds_drawn = 0
        self._sampler: PromptSampler | None = None  # the training data, as run() deals it
        self._eval_beside: tuple[threading.Thread, dict] | None = None  # an eval running beside training
        if self._chat is not None and not self._chat.chat_template:  # fail before any worker is configured
            raise ValueError(f"data.messages_key: {job.model} has no chat template to render conversations with")
        self._frame = None  # an agent job on chat prompts: observations as messages of the template
        if self._chat is not None and job.agent is not None:
            from services.coordinator.agents import ChatFrame

            self._frame = ChatFrame(self._tokenizer, job.agent.observation_role)

    # ---- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        """Configure the workers and give every engine the trainer's weights.

        An eval-only job may run without trainers: the engines then load the checkpoint (a
        Hugging Face folder) themselves. With trainers, they are configured eval_only (no
        optimizer, no scheduler, no optimizer state read) and push their weights as usual.
        """
        if not self.fleet.trainers and not self.job.eval_only:
            raise ValueError("fleet: the job needs a trainer and none is available")
        if not self.fleet.engines:
            raise ValueError("fleet: the job needs a rollout engine and none is available")
        config = trainer_config(self.job)
        self.checkpoint_step = 0
        if self.trainers is not None:
            status = self.trainers.configure(config)
            self.checkpoint_step = status.checkpoint_step
            where = ", ".join(t.address for t in self.fleet.trainers)
            self.emit(
                "log", 0,
                {"message": f"trainer {where} ready ({status.backend} backend, {status.world_size or 1} rank(s), "
                            f"{status.num_parameters} parameters on rank 0, "
                            f"optimizer: {'yes' if status.has_optimizer else 'none'})"},
            )
        if self.job.needs_critic:
            self._setup_critics()
        for index, engine in enumerate(self.fleet.engines):
            status = engine.configure(self._engine_config(index))
        self.fleet.in_pool = set(range(len(self.fleet.engines)))
        if self.fleet.trainers:
            sync = self.job.weight_sync
            exact = sync.verify == "exact"
            self.syncer = WeightSyncer(
                trainer=self.fleet.trainers[0], engines=self.fleet.engines,
                trainer_caps=self.fleet.trainers[0].capabilities, engine_caps=[e.capabilities for e in self.fleet.engines],
                forced=sync.plane, exact=exact, timeout_s=float(sync.timeout_s), token=self.fleet.trainer_token,
                pool=self._pool, policy=self._update_policy(), fanout=self._fanout,
            )
            self.emit("log", 0, {"message": f"weight planes: {dict(zip((e.address for e in self.fleet.engines), self.syncer.planes))}"})
            if self.job.trainer.offload:  # an offloaded trainer sleeps whenever it is not training
                self.trainers.sleep()
            self.sync_weights(step=0)
        else:
            self.weights_version, self.checkpoint_step = status.weight_version, status.checkpoint_step
            self.emit("log", 0, {"message": "no trainer: engines loaded the checkpoint themselves"})

    def _update_policy(self) -> str:
        """What engines do with the rows they are generating when new weights come: synchronous
        steps sync between generations (drain: nothing runs); asynchronous ones while the next
        step's samples generate (pause: rows go on under the new weights, their tokens tagged by
        version; or, with async.partial false, drain: the update waits for them)."""
        a = self.job.algorithm.async_
        return "pause" if self.job.algorithm.max_staleness > 0 and a.partial else "drain"

    def _setup_critics(self) -> None:
        want = self.job.critic.num_critics
        if len(self.fleet.critics) < want:
            raise ValueError(f"critic.num_critics: the job wants {want} critic(s) for algorithm.advantage ppo, "
                             f"the fleet has {len(self.fleet.critics)}")
        self.critics = TrainerGroup(self.fleet.critics[:want])
        status = self.critics.configure(critic_config(self.job))
        where = ", ".join(c.address for c in self.critics.ranks)
        self.emit("log", 0, {"message": f"critic {where} ready ({status.world_size or 1} rank(s), "
                                        f"{status.num_parameters} parameters with the value head)"})
        if self.job.critic_offload:
            self.critics.sleep()

    def _engine_config(self, index: int) -> rollout_pb2.RolloutConfig:
        exact = self.job.weight_sync.verify == "exact"
        sg = self.job.rollout.sglang
        return rollout_pb2.RolloutConfig(
            model_path=str(self.job.model),
            engine=self.job.rollout.engine,
            sglang=rollout_pb2.SglangConfig(
                url=sg.url or "", args=list(sg.args), command=list(sg.command),
                startup_timeout_s=sg.startup_timeout_s, memory_saver=sg.memory_saver,
                request_timeout_s=sg.request_timeout_s,
            ),
            device=self.job.rollout.device_of(index, self.job.trainer.device),
            dtype=self.job.trainer.dtype,
            seed=self.job.seed,
            # exact verification starts engines from scrambled weights: only the sync can fix them
            load_weights=not (exact and self.fleet.trainers),
            max_batch_size=self.job.rollout.max_batch_size,
            kv_cache_fraction=self.job.rollout.kv_cache_fraction,
            cuda_graphs=self.job.rollout.cuda_graphs,
            prefix_cache=self.job.rollout.prefix_cache,
        )

    def recover_engines(self, step: int) -> int:
        """Engines out of the pool whose worker now answers at another address (a restarted pod)
        are reached there, configured and given the current weights; how many came back."""
        if self.fleet.relocate is None or self.syncer is None:
            return 0
        moved = []
        for index in sorted(set(range(len(self.fleet.engines))) - self.fleet.in_pool):
            old = self.fleet.engines[index]
            new = self.fleet.relocate(index)
            if new is None or new.address == old.address or new.address in {e.address for e in self.fleet.engines}:
                continue
            try:
                new.configure(self._engine_config(index))
            except PeerError as e:
                self.emit("log", step, {"message": f"engine {index} at {new.address} is not ready yet: {e}"})
                continue
            self.fleet.engines[index] = new
            self.syncer.replace_engine(index, new)
            moved.append(index)
            self.emit("log", step, {"message": f"engine {index} moved from {old.address} to {new.address}; resyncing it"})
        if moved:
            self.sync_weights(step)  # the moved engines rejoin with the current version, or stay out
        return len(set(moved) & self.fleet.in_pool)

    def admit_engines(self, step: int) -> int:
        """An elastic job, between steps: engines newly listed by discovery are configured and
        given the current weights (verified) before they get any work; engines no longer listed
        get none. How many joined."""
        if self.fleet.discover is None or self.syncer is None:
            return 0
        listed = self.fleet.discover()
        for index, engine in enumerate(self.fleet.engines):
            if engine.address not in listed and index not in self.fleet.retired:
                self.fleet.retired.add(index)
                self.fleet.in_pool.discard(index)
                self.emit("log", step, {"message": f"engine {engine.address} is no longer listed: it gets no more work"})
            elif engine.address in listed and index in self.fleet.retired:
                self.fleet.retired.discard(index)  # listed again: the next sync brings it back
        known = {e.address for e in self.fleet.engines}
        joining = []
        for address in (a for a in listed if a not in known):
            client = self.fleet.connect(address)
            try:
                client.configure(self._engine_config(len(self.fleet.engines)))
                index = self.syncer.add_engine(client)
            except (PeerError, ValueError) as e:
                client.close()
                self.emit("log", step, {"message": f"engine {address} could not join yet: {e}"})
                continue
            self.fleet.engines.append(client)
            joining.append(index)
        if not joining:
            return 0
        result = self.syncer.sync(set(joining), only=set(joining))
        joined = sorted(result.ok & set(joining))
        self.fleet.in_pool |= set(joined)
        for index in joining:
            address = self.fleet.engines[index].address
            if index in result.ok:
                self.emit("log", step, {"message": f"engine {address} joined the pool at version {result.version}",
                                        "engine": address, "joined_version": result.version})
            else:
                self.emit("log", step, {"message": f"engine {address} took no weights and stays out of the pool: "
                                                   f"{result.failures.get(address, 'unknown')}"})
        return len(joined)

    # ---- weights -----------------------------------------------------------------------------
    def sync_weights(self, step: int) -> dict:
        """Every engine gets the trainer's current weights over its negotiated plane; an engine
        whose update fails leaves the pool (it keeps its old version) until a sync succeeds."""
        started = time.perf_counter()
        colocate = self.job.trainer.colocate
        if colocate:  # engines get their weight memory back first, their KV cache only after the sync
            self._on_engines(lambda e: e.resume_memory(["weights"]))
        listed = set(range(len(self.fleet.engines))) - self.fleet.retired
        result = self.syncer.sync(self.fleet.in_pool & listed, only=listed)
        self.fleet.in_pool = set(result.ok) - self.fleet.retired
        if colocate:
            self._on_engines(lambda e: e.resume_memory(["kv_cache"]))
        stats = {
            "version": result.version,
            "source": result.source,
            "bytes": result.total_bytes,
            "seconds": time.perf_counter() - started,
            "plane": ",".join(sorted(set(result.planes.values()))),
            "planes": result.planes,
            "engines_in_pool": len(self.fleet.in_pool),
            "failures": result.failures,
        }
        self.emit("weight_sync", step, stats)
        if not self.fleet.in_pool:
            raise WeightSyncFailed(f"weight sync to version {result.version} failed on every engine: {result.failures}")
        self.weights_version = result.version
        return stats

    def _on_engines(self, call) -> None:
        for index in range(len(self.fleet.engines)):
            try:
                call(self.fleet.engines[index])
            except PeerError as e:
                self.fleet.in_pool.discard(index)
                self.emit("log", 0, {"message": f"engine {e.peer} left the pool: {e}"})

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompts: list[str], sampling: rollout_pb2.SamplingParams, *,
                 priority: str = "train") -> list[Completion]:
        """Spread prompts over the engines in the pool; an engine that fails is retried elsewhere.
        `priority` eval: the engines admit these rows ahead of waiting train rows."""
        pending = list(range(len(prompts)))
        results: dict[int, list[Completion]] = {}
        while pending:
            pool = sorted(self.fleet.in_pool)
            if not pool:
                pool = self._wait_for_an_engine()
            shards = [pending[k :: len(pool)] for k in range(len(pool))]
            futures = {
                engine: self._generate_on(engine, [prompts[i] for i in shard], sampling, priority)
                for engine, shard in zip(pool, shards)
                if shard
            }
            pending = []
            wait_all([fut.pending for fut in futures.values()])
            for (engine, fut), shard in zip(futures.items(), [s for s in shards if s]):
                try:
                    per_prompt = fut.result()
                except PeerError as e:
                    log.warning("engine %s failed, retrying its prompts elsewhere: %s", e.peer, e)
                    self.fleet.in_pool.discard(engine)
                    self.emit("log", 0, {"message": f"engine {e.peer} left the pool: {e}"})
                    pending += shard
                    continue
                for prompt_index, group in zip(shard, per_prompt):
                    results[prompt_index] = group
        return [c for i in range(len(prompts)) for c in results[i]]

    def _wait_for_an_engine(self, wait_s: float = 300.0, poll_s: float = 2.0) -> list[int]:
        """Every engine has failed: wait (bounded) for one to come back at a new address."""
        deadline = time.monotonic() + (wait_s if self.fleet.relocate is not None else 0.0)
        while True:
            self._check_cancelled()
            self.recover_engines(step=0)
            if self.fleet.in_pool:
                return sorted(self.fleet.in_pool)
            if time.monotonic() >= deadline:
                raise RuntimeError("no rollout engine left in the pool")
            time.sleep(poll_s)

    def _generate_on(self, engine: int, prompts: list[str], sampling, priority: str) -> _Groups:
        """The call to engine `engine`, started: `result()` is each prompt's completions."""
        return _Groups(self.fleet.engines[engine].generate_async(prompts, sampling, priority=priority,
                                                                 fanout=self._fanout),
                       max(1, sampling.n))

    def _prompt_text(self, example: Example) -> str:
        """What an engine completes: the row's prompt, or its conversation in the chat template."""
        if example.messages is None:
            return example.prompt
        return self._chat.apply_chat_template(example.messages, add_generation_prompt=True)

    # ---- eval --------------------------------------------------------------------------------
    def evaluate(self, step: int, *, beside_training: bool = False) -> dict[str, float]:
        """Every eval set at the engines' weights now (`weights_version` in each eval event). Its
        tokens are checked against that version: `tokens_at_other_versions` counts any that are not."""
        scores = {}
        version = self.weights_version
        for ds, examples, reward in self._eval_sets:
            started = time.perf_counter()
            extra: dict[str, float] = {}
            if self.job.agent is not None:  # an agent job's eval is episodes in its environment
                episodes = self._run_episodes(examples, ds.sampling, seed=self.job.seed, priority="eval")
                extra = _episode_metrics(episodes)
                # (an episode whose environment failed is counted, not scored as a wrong answer)
                rewards = [ep.reward for ep in episodes if not ep.failed] or [0.0]
            else:
                prompts = [self._prompt_text(e) for e in examples]
                completions = self.generate(prompts, sampling_params(ds.sampling, seed=self.job.seed),
                                            priority="eval")
                extra["tokens_at_other_versions"] = sum(n for c in completions for v, n in c.versions if v != version)
                rewards = score_all(reward, [(c.text, e.answer, p, e.metadata)
                                             for c, e, p in zip(completions, examples, prompts)])
            scores[ds.name] = sum(rewards) / len(rewards)
            self.emit(
                "eval",
                step,
                {
                    "dataset": ds.name,
                    "score": scores[ds.name],
                    "num_prompts": len(examples),
                    "weights_version": version,
                    "seconds": time.perf_counter() - started,
                    "beside_training": beside_training,
                    **extra,
                },
            )
        return scores

    def _evaluate_beside_training(self, step: int) -> None:
        """Step `step`'s eval on a thread of its own while the next step trains. It stays at this
        step's weights: the next weight sync waits for it (`_finish_eval`)."""
        self._finish_eval()
        failure: dict = {}

        def run() -> None:
            try:
                self.evaluate(step, beside_training=True)
            except BaseException as e:  # noqa: BLE001 (raised on the job's thread by _finish_eval)
                failure["error"] = e

        thread = threading.Thread(target=run, name=f"eval-step-{step}", daemon=True)
        thread.start()
        self._eval_beside = (thread, failure)

    def _finish_eval(self) -> float | None:
        """Wait for the eval running beside training, if one is; its error is raised here. The
        seconds waited are returned (the trainer's wait for it), None when none was running."""
        if self._eval_beside is None:
            return None
        (thread, failure), started = self._eval_beside, time.perf_counter()
        while thread.is_alive():
            self._check_cancelled()
            thread.join(timeout=0.2)
        self._eval_beside = None
        if "error" in failure:
            raise failure["error"]
        return time.perf_counter() - started

    # ---- training ----------------------------------------------------------------------------
    def rl_step(self, step: int, examples: list[Example]) -> dict[str, float]:
        """One synchronous step: generate the batch with the current weights, then train on it."""
        self._between_steps(step)
        return self.learn(self.rollout(step, examples))

    def _between_steps(self, step: int) -> None:
        """Engines that moved come back, and an elastic job's new engines join (both synced)."""
        if len(self.fleet.in_pool) < len(self.fleet.engines):
            self.recover_engines(step)
        self.admit_engines(step)

    def rollout(self, step: int, examples: list[Example]) -> Rollout:
        """Step `step`'s samples: `samples_per_prompt` completions of each example's prompt, and
        their rewards. With dynamic sampling, groups whose rewards are all equal are dropped and
        more prompts (the sampler's next batches) generated until the step has prompts_per_step
        groups or `max_rounds` more rounds ran. Its metrics say how far into the data and the
        seeds the steps up to it went, for a resume to go on from there."""
        rollout = self._rollout(step, examples)
        position = {"batches_dealt": float(self._sampler.batches_dealt)} if self._sampler is not None else {}
        rollout.metrics = {**rollout.metrics, **position, "seeds_drawn": float(self._seeds_drawn)}
        return rollout

    def _next_seed(self) -> int:
        self._seeds_drawn += 1
        return self._rng.randrange(2**31)

    def _rollout(self, step: int, examples: list[Example]) -> Rollout:
        cfg = self.job.rollout
        first = rollout = self._generate_groups(step, examples)
        if cfg.dynamic_sampling is None:
            return rollout
        n, want, rounds, uniform = cfg.samples_per_prompt, cfg.prompts_per_step, 0, 0
        kept = None
        while True:
            varied = [g for g in range(len(rollout.examples)) if len(set(rollout.rewards[g * n : (g + 1) * n])) > 1]
            uniform += len(rollout.examples) - len(varied)
            part = select_groups(rollout, varied, n)
            kept = part if kept is None else _joined(kept, part)
            if len(kept.examples) >= want or rounds == cfg.dynamic_sampling.max_rounds:
                break
            rounds += 1
            rollout = self._generate_groups(step, self._sampler.next_batch())
            kept.generate_s += rollout.generate_s
            kept.reward_s += rollout.reward_s
        varied = min(want, len(kept.examples))
        if not kept.examples:  # nothing varied: the first batch, whose advantages are all 0
            kept = first
        kept = select_groups(kept, list(range(min(want, len(kept.examples)))), n)
        kept.metrics = {"groups_uniform": float(uniform), "generation_rounds": float(rounds + 1),
                        "groups_trained": float(varied)}  # (groups whose rewards varied)
        return kept

    def _generate_groups(self, step: int, examples: list[Example]) -> Rollout:
        if self.job.agent is not None:
            return self._episodes(step, examples)
        n = self.job.rollout.samples_per_prompt
        version = self.weights_version
        t0 = time.perf_counter()
        sampling = sampling_params(self.job.rollout.sampling, n=n, seed=self._next_seed())
        prompts = [self._prompt_text(e) for e in examples]
        completions = self.generate(prompts, sampling)
        generated = time.perf_counter() - t0
        rewards = score_all(self._reward, [(c.text, e.answer, p, e.metadata)
                                           for e, p, group in zip(examples, prompts, _groups(completions, n))
                                           for c in group])
        return Rollout(step, examples, prompts, completions, generated, version, rewards,
                       reward_s=time.perf_counter() - t0 - generated)

    def _episodes(self, step: int, examples: list[Example]) -> Rollout:
        """`samples_per_prompt` multi-turn episodes of each example (`agents.run_episodes`), every
        live episode's turn spread over the engines in one round; each episode becomes one
        completion: its turns and observations as token ids, loss mask 0 on the observations."""
        cfg = self.job.rollout
        n, version, t0 = cfg.samples_per_prompt, self.weights_version, time.perf_counter()
        episodes = self._run_episodes([e for e in examples for _ in range(n)], cfg.sampling)
        failed = [ep for ep in episodes if ep.failed]
        if failed:
            self.emit("log", step, {"message": f"{len(failed)} episodes' environment failed, their groups dropped: "
                                               f"{failed[0].failed}"})
        completions = [Completion(prompt_index=i, prompt_ids=ep.ids[: ep.prompt_len], output_ids=ep.response_ids,
                                  text=self._tokenizer.decode(ep.response_ids), logprobs=ep.logprobs,
                                  finish_reason="length" if ep.truncated else "stop",
                                  weight_version=min(ep.versions, default=version), loss_mask=ep.mask)
                       for i, ep in enumerate(episodes)]
        rollout = Rollout(step, examples, [self._prompt_text(e) for e in examples], completions,
                          time.perf_counter() - t0, version, [ep.reward for ep in episodes])
        kept = [g for g in range(len(examples)) if not any(ep.failed for ep in episodes[g * n : (g + 1) * n])]
        rollout = select_groups(rollout, kept, n)
        rollout.metrics = _episode_metrics(episodes)
        return rollout

    def _run_episodes(self, examples: list[Example], sampling: SamplingConfig, *, seed: int | None = None,
                      priority: str = "train") -> list:
        """One episode of each example in the job's environment, to its end (`agents.run_episodes`).
        `seed`: every turn sampled with it (eval: the same episodes each time); else a fresh one."""
        from services.coordinator import agents

        agent = self.job.agent
        scratch = tempfile.TemporaryDirectory(prefix="rlfleet-tools-") if agent.environment == "python" else None
        tools = (lambda i: {"python": agents.python_tool(Path(scratch.name) / str(i))}) if scratch else (lambda i: {})
        if agent.environment == "remote":
            if self._remote_envs is None:
                self._remote_envs = agents.RemoteEnvironments(agent.address, self.fleet.trainer_token or None,
                                                              timeout_s=agent.timeout_s,
                                                              max_observation_bytes=agent.max_observation_bytes)
            envs = [self._remote_envs.new() for _ in examples]
        else:
            envs = [agents.Calculator(max_calls=agent.max_tool_calls, prompt=self._prompt_text, tools=tools(i))
                    for i in range(len(examples))]
        stops = tuple(dict.fromkeys((*sampling.stop, agents.TOOL_CALL_END)))

        def generate(prompts_ids: list[list[int]], max_new_tokens: int) -> list[Completion]:
            turn = replace(sampling, max_new_tokens=max_new_tokens, stop=stops)
            params = sampling_params(turn, seed=self._next_seed() if seed is None else seed)
            return self.generate(prompts_ids, params, priority=priority)

        try:
            return agents.run_episodes(envs, examples, self._tokenizer, generate,
                                       max_new_tokens=sampling.max_new_tokens, max_turns=agent.max_turns,
                                       max_tokens=agent.max_tokens, frame=self._frame)
        finally:
            if scratch is not None:  # each episode's sandbox folder
                scratch.cleanup()

    def learn(self, rollout: Rollout, extra: dict[str, float] | None = None) -> dict[str, float]:
        """Rewards, advantages, a train step and a weight sync on one step's samples; the step's
        metrics (with `extra`'s) are emitted and returned."""
        import torch

        from services.coordinator.advantages import compute_advantages

        job, algo = self.job, self.job.algorithm
        step, examples, prompts, completions = rollout.step, rollout.examples, rollout.prompts, rollout.completions
        n = job.rollout.samples_per_prompt
        if not completions:  # every group was dropped (their environments failed): nothing to train on
            metrics = {"samples": 0.0, "generate_s": rollout.generate_s, **rollout.metrics, **(extra or {})}
            self.emit("log", step, {"message": "no sample to train on this step: the weights stay as they are"})
            self.emit("step", step, metrics)
            return metrics
        t1 = time.perf_counter()
        rewards = torch.tensor(rollout.rewards).view(len(examples), n)  # [P, n]
        if job.trainer.colocate:  # the engines' memory goes to the trainer while it trains
            self._on_engines(lambda e: e.release_memory(["kv_cache", "weights"]))
        trainer = self.trainers
        kl_reward = None
        critic_metrics: dict[str, float] = {}
        if self.critics is not None:  # PPO: per-token advantages from GAE over the critic's values
            batch, critic_metrics = self._ppo_batch(completions, rewards)
        else:
            if algo.needs_ref and not algo.use_kl_loss:  # KL as a reward penalty: kl_coef * sum_t (logp - ref)
                kl_reward = self._kl_in_reward(completions).view(len(examples), n)  # [P, n]
                rewards = rewards - algo.kl_coef * kl_reward
            advantages = compute_advantages(algo.advantage, rewards, normalize_std=algo.normalize_std).view(-1)
            batch = _policy_batch(completions, advantages.tolist())  # (floats: not a 0-d tensor each)
        if algo.needs_ref and algo.use_kl_loss:
            for sample, ref in zip(batch.samples, trainer.compute_logprobs("ref", batch)):
                sample.ref_logprobs.extend(ref)
        train_metrics: dict[str, float] = {}
        if self.critics is None or step > job.critic.warmup_steps:  # in critic warm-up the policy waits
            train_metrics, _ = trainer.train_step(batch)
        slept = time.perf_counter()
        if job.trainer.offload:  # every sync of an offloaded trainer reads its host copy
            trainer.sleep()
        t2 = time.perf_counter()
        eval_wait = self._finish_eval()  # an eval beside this step keeps its weights until it ends
        sync = self.sync_weights(step)
        lengths = [len(c.output_ids) for c in completions]
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "solved_groups": float((rewards.max(dim=1).values > 0).float().mean()),
            "response_len_mean": sum(lengths) / len(lengths),
            "samples": float(len(completions)),
            "truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "generate_s": rollout.generate_s,
            "reward_s": rollout.reward_s,
            "train_s": t2 - t1,
            "sync_s": sync["seconds"],
            "sync_from_host": float(sync["source"] == "host"),
            **({"sleep_s": t2 - slept} if job.trainer.offload else {}),
            **({"eval_wait_s": eval_wait} if eval_wait is not None else {}),
            **({"kl_reward_mean": float(kl_reward.mean())} if kl_reward is not None else {}),
            "weights_version": float(self.weights_version),
            **critic_metrics,
            **rollout.metrics,
            **(extra or {}),
            **{f"train/{k}": v for k, v in train_metrics.items()},
        }
        self.emit("step", step, metrics)
        return metrics

    def _ppo_batch(self, completions: list[Completion], rewards: torch.Tensor) -> tuple[trainer_pb2.Batch, dict]:
        """The actor's batch with GAE advantages per token, after one value-loss step of the critic.

        Each response's token rewards are the outcome reward on its last token, minus
        kl_coef * (logp - ref) on every token when the KL penalty is in the reward. The critic's
        values (before its update) give GAE advantages and returns; the critic then regresses
        onto the returns. Offloaded, the actor sleeps while the critic works and the critic
        sleeps before the actor trains: one model is on the device at a time.
        """
        from services.coordinator.advantages import explained_variance, gae, whiten_tokens

        algo, started = self.job.algorithm, time.perf_counter()
        outcome = rewards.reshape(-1).tolist()
        scored = [i for i, c in enumerate(completions) if c.output_ids]
        batch = trainer_pb2.Batch(samples=[
            trainer_pb2.Sample(prompt_ids=completions[i].prompt_ids, response_ids=completions[i].output_ids,
                               old_logprobs=completions[i].logprobs)
            for i in scored
        ])
        token_rewards = [[0.0] * len(completions[i].output_ids) for i in scored]
        metrics: dict[str, float] = {}
        if algo.needs_ref and not algo.use_kl_loss:
            refs = self._ref_logprobs(completions)
            if self.job.trainer.offload:
                self.trainers.sleep()
            kl_total = 0.0
            for row, i in zip(token_rewards, scored):
                for t, (logp, ref_logp) in enumerate(zip(completions[i].logprobs, refs[i])):
                    row[t] -= algo.kl_coef * (logp - ref_logp)
                    kl_total += logp - ref_logp
            metrics["kl_reward_mean"] = kl_total / len(completions)
        for row, i in zip(token_rewards, scored):
            row[-1] += outcome[i]
        values = self.critics.compute_values(batch) if scored else []
        estimates = [gae(r, v, algo.gamma, algo.lam) for r, v in zip(token_rewards, values)]
        advantages = [a for a, _ in estimates]
        returns = [r for _, r in estimates]
        if algo.whiten_advantages:
            advantages = whiten_tokens(advantages)
        for sample, adv in zip(batch.samples, advantages):
            sample.advantages.extend(adv)
        critic_batch = trainer_pb2.Batch(samples=[
            trainer_pb2.Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, returns=r, old_values=v)
            for s, r, v in zip(batch.samples, returns, values)
        ])
        critic_train, _ = self.critics.train_step(critic_batch, value=True) if scored else ({}, 0)
        if self.job.critic_offload:
            self.critics.sleep()
        flat_values = [v for row in values for v in row]
        flat_returns = [r for row in returns for r in row]
        ev = explained_variance(flat_values, flat_returns)
        metrics.update({
            "value_loss": critic_train.get("value_loss", 0.0),
            **({"explained_variance": ev} if ev == ev else {}),  # NaN when the returns do not vary
            "values_mean": sum(flat_values) / max(len(flat_values), 1),
            "returns_mean": sum(flat_returns) / max(len(flat_returns), 1),
            "critic_s": time.perf_counter() - started,
            **{f"critic/{k}": v for k, v in critic_train.items()},
        })
        return batch, metrics

    def _kl_in_reward(self, completions: list[Completion]) -> torch.Tensor:
        """Per completion, sum over its tokens of (engine logprob - ref logprob): the k1 estimate
        of KL(policy || ref) for the sequence (0 for an empty completion)."""
        import torch

        return torch.tensor([sum(c.logprobs) - sum(ref) if c.output_ids else 0.0
                             for c, ref in zip(completions, self._ref_logprobs(completions))])

    def _ref_logprobs(self, completions: list[Completion]) -> list[list[float]]:
        """The `ref` copy's logprobs of every completion's tokens (none for an empty completion)."""
        scored = [i for i, c in enumerate(completions) if c.output_ids]
        batch = trainer_pb2.Batch(samples=[trainer_pb2.Sample(prompt_ids=completions[i].prompt_ids,
                                                              response_ids=completions[i].output_ids) for i in scored])
        refs: list[list[float]] = [[] for _ in completions]
        for i, ref in zip(scored, self.trainers.compute_logprobs("ref", batch) if scored else []):
            refs[i] = ref
        return refs

    def sft_stage(self) -> None:
        sft = self.job.sft
        columns = replace(self.job.data.columns, trajectories=sft.conversations)
        examples = load_examples(sft.data, columns)
        tokenizer = load_tokenizer(self.job.model)
        sampler = PromptSampler(examples, sft.batch_size, seed=self.job.seed, shuffle=True)
        for i in range(sft.steps):
            self._check_cancelled()
            batch = trainer_pb2.Batch(samples=[self._sft_sample(tokenizer, e) for e in sampler.next_batch()])
            metrics, _ = self.trainers.train_step(batch, sft=True, lr=sft.lr)
            self.emit("sft", i + 1, metrics)
        self.sync_weights(step=0)

    def _sft_sample(self, tokenizer, example: Example) -> trainer_pb2.Sample:
        """A prompt and its answer; with sft.conversations, a whole conversation, trained on its
        assistant turns only (`agents.trajectory_tokens`)."""
        if self.job.sft.conversations:
            from services.coordinator.agents import trajectory_tokens

            prompt_ids, response_ids, mask = trajectory_tokens(tokenizer, example.messages)
            return trainer_pb2.Sample(prompt_ids=prompt_ids, response_ids=response_ids, loss_mask=mask)
        return trainer_pb2.Sample(prompt_ids=tokenizer.encode(self._prompt_text(example)),
                                  response_ids=tokenizer.encode(example.answer) + [tokenizer.eos_token_id])

    # ---- the job -----------------------------------------------------------------------------
    def run(self) -> dict:
        started = time.time()
        job = self.job
        self._rng = random.Random(job.seed)
        self._seeds_drawn = 0
        self.setup()
        if job.eval_only:
            return self._evaluate_checkpoint(started)
        first = 1
        if self.resume is not None:
            before, first = self._resume(), self.resume.step + 1
        else:
            if job.sft is not None:
                self.sft_stage()
            before = self.evaluate(step=0)
            self.emit("log", 0, {"message": f"eval before training: {before}"})
        scores = dict(before)
        step = first - 1
        if job.num_rollout > 0:
            examples = open_dataset(job.data.train, job.data.columns)  # rows are read as batches are dealt
            self._reward = build_reward(job.reward, self.fleet.trainer_token or None)
            sampler = PromptSampler(examples, job.rollout.prompts_per_step, seed=job.seed, shuffle=job.data.shuffle)
            self._sampler = sampler  # (dynamic sampling draws more batches from it)
            # the batches the steps up to the checkpoint drew, unread, and their sampling seeds
            resume = self.resume if self.resume is not None and self.resume.batches_dealt is not None else None
            sampler.skip_batches(resume.batches_dealt if resume else first - 1)
            for _ in range(resume.seeds_drawn if resume else first - 1):
                self._next_seed()
            steps = self._async_steps(sampler, first) if job.algorithm.max_staleness > 0 else None
            try:
                for step, _ in steps or self._sync_steps(sampler, first):  # each trained, its weights synced
                    last = step == job.num_rollout
                    if job.eval.every and step % job.eval.every == 0 and not last:
                        if steps is not None and job.eval.overlap:
                            self._evaluate_beside_training(step)
                        else:
                            scores = self.evaluate(step)
                    if job.checkpoint.every and (step % job.checkpoint.every == 0 or last):
                        self.save_checkpoint(step)
            finally:
                if steps is not None:
                    steps.close()
            self._finish_eval()
            scores = self.evaluate(step)
        primary = job.eval.datasets[0].name
        return {
            "name": job.name,
            "eval_before": before[primary],
            "eval_after": scores[primary],
            "eval_dataset": primary,
            "evals_before": before,
            "evals_after": scores,
            "steps": step,
            "weights_version": self.weights_version,
            "wall_s": time.time() - started,
        }

    def _sync_steps(self, sampler: PromptSampler, first: int) -> Iterator[tuple[int, dict]]:
        for step in range(first, self.job.num_rollout + 1):
            self._check_cancelled()
            yield step, self.rl_step(step, sampler.next_batch())

    def _async_steps(self, sampler: PromptSampler, first: int) -> AsyncSteps:
        """Steps whose samples the engines generate while earlier steps train (`pipeline`)."""
        def learn(rollout: Rollout, extra: dict) -> dict:
            self._between_steps(rollout.step)
            return self.learn(rollout, extra)

        def dropped(step: int, count: int) -> None:
            self.emit("log", step, {"message": f"{count} samples more than {self.job.algorithm.max_staleness} "
                                               "versions behind the trainer were dropped"})

        return AsyncSteps(first=first, last=self.job.num_rollout, max_staleness=self.job.algorithm.max_staleness,
                          group_size=self.job.rollout.samples_per_prompt,
                          produce=lambda step: self.rollout(step, sampler.next_batch()), learn=learn,
                          version=lambda: self.weights_version, check_cancelled=self._check_cancelled,
                          on_drop=dropped)

    def _resume(self) -> dict[str, float | None]:
        """Load the checkpoint into every trainer and the engines; the evals before training are
        the stored ones."""
        resume = self.resume
        self.trainers.load_checkpoint(resume.path, load_optimizer=True)
        if self.critics is not None:
            self.critics.load_checkpoint(str(Path(resume.path) / CRITIC_DIR), load_optimizer=True)
        self.sync_weights(step=resume.step)
        self.emit("log", resume.step, {"message": f"resumed from the checkpoint of step {resume.step} ({resume.path})"})
        return dict(resume.evals_before)

    def _evaluate_checkpoint(self, started: float) -> dict:
        """Eval-only: every eval dataset once, labelled with the checkpoint's training step."""
        scores = self.evaluate(step=self.checkpoint_step)
        primary = self.job.eval.datasets[0].name
        return {
            "name": self.job.name,
            "eval_only": True,
            "checkpoint": str(self.job.model),
            "checkpoint_step": self.checkpoint_step,
            "eval_before": scores[primary],
            "eval_after": scores[primary],
            "eval_dataset": primary,
            "evals_before": scores,
            "evals_after": scores,
            "steps": 0,
            "trainers": len(self.fleet.trainers),
            "weights_version": self.weights_version,
            "wall_s": time.time() - started,
        }

    def save_checkpoint(self, step: int) -> None:
        base = self.job.checkpoint.dir or Path(self.job.output_dir or "runs") / "checkpoints"
        directory = Path(base) / f"step-{step:06d}"
        self.trainers.save_checkpoint(str(directory))
        if self.job.trainer.offload:  # saving woke it; offloaded, it sleeps whenever it is not training
            self.trainers.sleep()
        if self.critics is not None:  # the critic's own checkpoint, beside the policy's
            self.critics.save_checkpoint(str(directory / CRITIC_DIR))
            if self.job.critic_offload:
                self.critics.sleep()
        self.emit("checkpoint", step, {"path": str(directory)})

    def _check_cancelled(self) -> None:
        if self.cancelled.is_set():
            raise JobCancelled("job cancelled")

    def close(self) -> None:
        if getattr(self, "syncer", None) is not None:
            self.syncer.close()
        if getattr(self, "_remote_envs", None) is not None:
            self._remote_envs.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._fanout.close()
        if self.trainers is not None:
            self.trainers.close()
        if self.critics is not None:
            self.critics.close()


def _serialized(emit: Emit) -> Emit:
    """`emit`, one event at a time whichever thread calls it."""
    lock = threading.Lock()

    def serialized(kind: str, step: int, data: dict) -> None:
        with lock:
            emit(kind, step, data)

    return serialized


class _Groups:
    """A Generate call under way; `result()` splits its completions into each prompt's n."""

    def __init__(self, pending: Pending, n: int):
        self.pending, self._n = pending, n

    def result(self) -> list[list[Completion]]:
        return _groups(self.pending.result(), self._n)


def _joined(a: Rollout, b: Rollout) -> Rollout:
    """a's groups, then b's (as one step's samples; a's step and version, the older)."""
    return replace(a, examples=a.examples + b.examples, prompts=a.prompts + b.prompts,
                   completions=a.completions + b.completions, rewards=a.rewards + b.rewards,
                   version=min(a.version, b.version))


def _episode_metrics(episodes: list) -> dict[str, float]:
    return {
        "episodes_failed": float(sum(bool(ep.failed) for ep in episodes)),
        "tool_call_frac": sum(ep.tool_calls > 0 for ep in episodes) / len(episodes),
        "tool_calls_mean": sum(ep.tool_calls for ep in episodes) / len(episodes),
        "turns_mean": sum(ep.turns for ep in episodes) / len(episodes),
        "episodes_truncated_frac": sum(ep.truncated for ep in episodes) / len(episodes),
    }


def _policy_batch(completions: list[Completion], advantages: list[float]) -> trainer_pb2.Batch:
    """The policy's batch: every non-empty completion with its advantage. Filled field by field
    with `extend`, which copies a reply's repeated fields without a Python object per token (three
    times faster than a Sample built from keywords, at thousands of samples a step)."""
    batch = trainer_pb2.Batch()
    add = batch.samples.add
    for c, adv in zip(completions, advantages):
        if c.output_ids:
            sample = add(advantage=adv)
            sample.prompt_ids.extend(c.prompt_ids)
            sample.response_ids.extend(c.output_ids)
            sample.old_logprobs.extend(c.logprobs)
            sample.loss_mask.extend(c.loss_mask)
    return batch


def _groups(completions: list[Completion], n: int) -> list[list[Completion]]:
    return [completions[i : i + n] for i in range(0, len(completions), n)]
