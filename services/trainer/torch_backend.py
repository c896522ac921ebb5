"""The torch trainer backend: one policy model, its frozen tag copies, AdamW and an LR schedule.

It runs the same code on CPU and GPU. `compute_logprobs` and `train_step` take lists of
`Sample`s and split them into micro-batches; gradients are accumulated so that the loss equals
the loss over the whole batch whatever the micro-batch size. In eval-only mode no optimizer or
scheduler is ever built, so schedule settings that only make sense while training are not read.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from pathlib import Path

import torch

from services.models import load_hf_dir
from services.models.checkpoint import checkpoint_step
from services.trainer import checkpoint, losses
from services.trainer.backend import LifecycleState, StepResult, SyncWeights, TrainerStateError
from services.trainer.batch import PackedBatch, Sample, micro_batches, pack
from services.trainer.ranks import DataParallel, world
from services.trainer.host_store import ACTOR, HostStore
from services.trainer.offload import Offloader
from services.trainer.settings import SchedulerSettings, TrainerSettings
from services.weights.apply import named_weights
from services.models import memory
from services.weights.buckets import parse_dtype, plan_buckets
from services.weights.fingerprint import fingerprint

log = logging.getLogger("rlfleet.trainer")


def lr_lambda(settings: SchedulerSettings):
    """Multiplier of the base LR at a step: linear warm-up, then constant / linear / cosine decay."""
    settings.check_decay()
    warmup, decay, floor = settings.warmup_steps, settings.decay_steps, settings.min_lr_ratio

    def multiplier(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if settings.kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / (decay - warmup))
        if settings.kind == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


class TorchTrainer:
    """Policy model, optimizer and the memory lifecycle of one trainer rank.

    Tags share the one live model: `use(tag)` loads that tag's values from the host store, and
    skips the copy when the device already holds the tag at its current version, unless the
    restore rebuilds weights (fp32 master weights), which always runs.
    """

    def __init__(self, settings: TrainerSettings):
        self.settings = settings
        self.device = torch.device(settings.device)
        torch.manual_seed(settings.seed)
        self.dp = self._build_model()
        self.pad_id = self.model_config.pad_token_id or 0
        if self.dp.size > 1 and "old_actor" in settings.tags:
            raise ValueError("tags: old_actor is captured when rank 0 serves a weight sync, which the other "
                             "data-parallel ranks never see; it is not supported with several ranks yet")
        self.params = self._trainable()
        # Weights live in the sync bucket layout: a bucket of live weights is a view, never packed.
        self.layout = plan_buckets(list(self.named.items()), settings.bucket_bytes)
        self.bucket_views = self._lay_out_weights()
        self.master: list[torch.Tensor] | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        if not settings.eval_only:
            self._build_optimizer()
        self.step = 0
        self.weights_version = 0
        self.checkpoint_step = checkpoint_step(settings.model_path)
        self.asleep = False
        self.active_tag = ACTOR
        self.rebuilds = 0
        self._device_holds: tuple[str, int] | None = (ACTOR, 0)
        self.store: HostStore | None = None
        self._hash_stream = None  # where fingerprints of captured host copies are made (CUDA)
        if settings.tags or settings.offload or settings.colocate:
            self.store = HostStore(list(self.named.items()), settings.bucket_bytes, share=self._shared_tags())
            for tag in dict.fromkeys(settings.tags):
                self.store.capture(tag, self.named, version=0)
        self.offloader = Offloader(self.params, pinned=torch.cuda.is_available(), scratch=self._scratch_buffers())

    def _build_model(self) -> DataParallel:
        """Load the policy (`model_config`, `model`, `named`: the parameters by name) and return
        how batches split across ranks. Every rank of a torch trainer group holds the whole model
        and trains a shard of each batch (data parallel)."""
        self.model_config, self.model = load_hf_dir(
            self.settings.model_path, dtype=parse_dtype(self.settings.dtype), device=self.device
        )
        self.named = dict(named_weights(self.model))
        compile_layers(self.model.model.layers, self.settings)
        return DataParallel(torch.distributed.group.WORLD if world()[1] > 1 else None, self.device)

    def _lay_out_weights(self) -> list[torch.Tensor] | None:
        """Move the weights into the sync bucket layout; the buckets as views (None: the backend
        lays its weights out itself, and never syncs from them live)."""
        return memory.lay_out(
            self.named, [[(t.name, t.offset) for t in b.tensors] for b in self.layout], [b.nbytes for b in self.layout]
        )

    def _build_optimizer(self) -> None:
        """AdamW (over fp32 master weights when asked) and the LR schedule; never in eval-only."""
        settings = self.settings
        if settings.master_weights == "fp32":
            if settings.dtype == "float32":
                raise ValueError("master_weights: fp32 master weights need dtype bfloat16 or float16")
            self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        opt = settings.optimizer
        self.optimizer = torch.optim.AdamW(
            self.master if self.master is not None else self.params,
            lr=opt.lr,
            betas=(opt.beta1, opt.beta2),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            # one kernel per step instead of a dozen per tensor group: 30 ms -> a few ms for
            # 1.5B fp32 master weights on an H200 (the same update, computed in one pass)
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(settings.scheduler))

    @property
    def schedule_position(self) -> int:
        """How many scheduled steps the LR schedule has taken (saved with the optimizer state)."""
        return self.scheduler.last_epoch

    @schedule_position.setter
    def schedule_position(self, steps: int) -> None:
        self.scheduler.last_epoch = steps

    def optimizer_params(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps, in the order of its state indices."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _scratch_buffers(self) -> list[torch.Tensor]:
        """Device buffers sleep frees without keeping their values (rewritten every step)."""
        return []

    def _trainable(self) -> list[torch.Tensor]:
        """The parameters the optimizer steps, offload moves and gradients reach."""
        return [p for p in self.model.parameters() if p.requires_grad]

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def has_optimizer(self) -> bool:
        return self.optimizer is not None

    @property
    def has_scheduler(self) -> bool:
        return self.scheduler is not None

    @property
    def rank(self) -> int:
        return world()[0]

    # ---- memory lifecycle --------------------------------------------------------------------
    def _state_tensors(self) -> list[torch.Tensor]:
        tensors = list(self.master or [])
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        return tensors

    def lifecycle(self) -> LifecycleState:
        host = (self.store.nbytes if self.store else 0) + self.offloader.host_bytes
        return LifecycleState(
            asleep=self.asleep,
            active_tag=self.active_tag,
            weights_version=self.weights_version,
            gpu_bytes_in_use=0 if self.asleep else self.offloader.device_bytes(self._state_tensors()),
            host_backup_bytes=host if self.asleep else (self.store.nbytes if self.store else 0),
        )

    def _shared_tags(self) -> tuple[str, ...]:
        """On a GPU the actor copy goes in shared memory: an engine on the same GPU then copies
        it host->device itself while the trainer sleeps (no staging on the trainer's GPU)."""
        return (ACTOR,) if self.device.type == "cuda" else ()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def _ensure_store(self) -> HostStore:
        if self.store is None:
            self.store = HostStore(list(self.named.items()), self.settings.bucket_bytes, share=self._shared_tags())
        return self.store

    def _capture_actor(self, wait: bool = True) -> None:
        """Make the host actor copy current (only ever called while the device holds the actor)."""
        store = self._ensure_store()
        if store.version(ACTOR) == self.weights_version:
            return
        side = None
        if self.device.type == "cuda" and self.bucket_views is not None:  # forked before the copies are queued, so it runs beside them
            if self._hash_stream is None:  # one for good: the allocator reuses scratch per stream
                self._hash_stream = torch.cuda.Stream(self.device)
            side = self._hash_stream
            side.wait_stream(torch.cuda.current_stream(self.device))
        store.capture(ACTOR, self.named, self.weights_version, wait=wait)
        if side is not None:
            # The bucket fingerprints a later sync from this copy needs, made on the device while
            # the device->host copy runs (HBM reads beside PCIe transfers: nearly free).
            with torch.cuda.stream(side):
                store.get(ACTOR).fingerprints["fast"] = [fingerprint(b, "fast") for b in self.bucket_views]

    def sleep(self) -> LifecycleState:
        if not self.asleep:
            if self.active_tag == ACTOR:
                self._capture_actor(wait=False)  # release() waits once for these and its own copies
            self.offloader.release(self._state_tensors())
            self.asleep, self._device_holds = True, None
        return self.lifecycle()

    def wake(self) -> LifecycleState:
        if self.asleep:
            self.offloader.reallocate(self._state_tensors())
            self._restore_actor()
            self.asleep, self.active_tag = False, ACTOR
            self._device_holds = (ACTOR, self.weights_version)
        return self.lifecycle()

    def _restore_actor(self) -> None:
        if self.master is not None:  # rebuild the low-precision weights from the fp32 master copy
            with torch.no_grad():
                for p, m in zip(self.params, self.master):
                    p.copy_(m)
            self.rebuilds += 1
        else:
            self.store.restore(ACTOR, self.named)

    def _version_of(self, tag: str) -> int:
        return self.weights_version if tag == ACTOR else self.store.version(tag)

    def use(self, tag: str) -> None:
        """Make the live model hold `tag`'s weights (waking the trainer if it sleeps)."""
        tag = tag or ACTOR
        if tag != ACTOR and (self.store is None or tag not in self.store.tags):
            loaded = ", ".join([ACTOR, *(t for t in (self.store.tags if self.store else []) if t != ACTOR)])
            raise ValueError(f"tag: {tag!r} is not loaded (loaded: {loaded})")
        if self.asleep:
            self.wake()
        rebuilds = tag == ACTOR and self.master is not None
        if self._device_holds == (tag, self._version_of(tag)) and not rebuilds:
            return
        if self.active_tag == ACTOR and tag != ACTOR:
            self._capture_actor()
        if tag == ACTOR:
            self._restore_actor()
        else:
            self.store.restore(tag, self.named)
        self.active_tag = tag
        self._device_holds = (tag, self._version_of(tag))

    def weights_for_sync(self) -> SyncWeights | None:
        """Where a weight sync reads: the host actor copy while asleep, colocated or when another
        tag is active; the live weights otherwise. `old_actor`, when kept, becomes what is synced.
        Every rank holds the whole model; rank 0 is the group's source."""
        if self.rank != 0:
            return None
        if self.asleep or self.settings.colocate or self.active_tag != ACTOR:
            if self.active_tag == ACTOR and not self.asleep:
                self._capture_actor()
            sync = SyncWeights("host", self.store.get(ACTOR), self.store.layout, None)
        else:
            sync = SyncWeights("gpu", self.named, self.layout, self.bucket_views)
        weights = sync.weights
        if self.store is not None and "old_actor" in self.store.tags:
            if sync.source == "host":
                self.store.load_bytes_into("old_actor", weights)
            else:
                self.store.capture("old_actor", weights, self.weights_version)
        return sync

    # ---- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self, path: str, *, include_optimizer: bool) -> None:
        """Rank 0 writes the whole checkpoint: every data-parallel rank holds the same weights and
        optimizer state, and two ranks writing one folder would race on its files."""
        if self.rank == 0:
            self._write_checkpoint(Path(path), include_optimizer)

    def _write_checkpoint(self, directory: Path, include_optimizer: bool) -> None:
        checkpoint.save(self, str(directory), include_optimizer=include_optimizer)

    def load_checkpoint(self, path: str, *, load_optimizer: bool) -> None:
        """Load weights (and, unless eval-only, optimizer state when asked) from a checkpoint."""
        self.use(ACTOR)
        source = self._checkpoint_weights(path)
        state = checkpoint.read_state(path)
        if load_optimizer and self.optimizer is not None:  # eval-only: never opened, never read
            checkpoint.load_optimizer(self, path, self._optimizer_file())
        with torch.no_grad():
            self._load_weights(source)
            for p, m in zip(self.params, self.master or []):
                m.copy_(p)
        self.step, self.weights_version = int(state["step"]), int(state["weights_version"])
        self._device_holds = (ACTOR, self.weights_version)
        if self.store is not None:
            self.store.invalidate(ACTOR)

    def _optimizer_file(self) -> str:
        """This rank's optimizer state file in a checkpoint folder."""
        return checkpoint.OPTIMIZER_FILE

    def _checkpoint_weights(self, path: str) -> dict[str, torch.Tensor]:
        """A checkpoint's weights by name, checked against this model (CheckpointError otherwise)."""
        _, loaded = load_hf_dir(path, dtype=parse_dtype(self.settings.dtype), device=self.device)
        source = dict(named_weights(loaded))
        extra = sorted(set(source) - set(self.named))
        if extra:
            raise checkpoint.CheckpointError(f"checkpoint {path}: tensor {extra[0]!r} does not belong to this model")
        for name, target in self.named.items():
            if name not in source:
                raise checkpoint.CheckpointError(f"checkpoint {path}: tensor {name!r} is missing")
            if source[name].shape != target.shape:
                raise checkpoint.CheckpointError(
                    f"checkpoint {path}: tensor {name!r} is {list(source[name].shape)}, the model has {list(target.shape)}"
                )
        return source

    def _load_weights(self, source: dict[str, torch.Tensor]) -> None:
        """Copy checked checkpoint weights into the live model (under no_grad)."""
        for name, target in self.named.items():
            target.copy_(source[name])

    # ---- compute -----------------------------------------------------------------------------
    def _pack(self, samples: list[Sample]) -> PackedBatch:
        return pack(samples, pad_id=self.pad_id, vocab_size=self.model_config.vocab_size, device=self.device)

    def _forward(self, batch: PackedBatch) -> torch.Tensor:
        logits = self.model(batch.input_ids, attention_mask=batch.attention_mask)  # [B, T, V]
        return logits[:, :-1]  # [B, T-1, V], in the model's dtype: the losses compute in float32

    @torch.no_grad()
    def compute_logprobs(self, tag: str, samples: list[Sample]) -> tuple[list[list[float]], float]:
        """Per-token logprobs of every sample (each data-parallel rank computes its shard, and all
        ranks return the whole batch's) and the mean entropy over response tokens."""
        self.use(tag)
        self._check(samples)
        shard = self.dp.shard(len(samples))
        results: list[list[float]] = []
        totals = {"entropy": 0.0, "tokens": 0.0}
        for chunk in micro_batches(samples[shard], self.settings.micro_batch_size):
            batch = self._pack(chunk)
            logits = self._forward(batch)
            results += batch.response_values(losses.gather_logprobs(logits, batch.targets))
            totals["entropy"] += float((losses.entropy_from_logits(logits) * batch.response_mask).sum())
            totals["tokens"] += float(batch.response_mask.sum())
        results = self.dp.gather_values([len(s.response_ids) for s in samples], shard, results)
        totals = self.dp.combine_metrics(totals)
        return results, totals["entropy"] / max(totals["tokens"], 1.0)

    def _check(self, samples: list[Sample]) -> None:
        """Refuse a bad batch on every rank alike, before any rank enters a collective."""
        pack(samples, pad_id=self.pad_id, vocab_size=self.model_config.vocab_size, device="cpu")

    def compute_values(self, samples: list[Sample]) -> list[list[float]]:
        raise TrainerStateError("ComputeValues: this trainer is an actor; values come from a critic "
                                "(a trainer configured with role: critic)")

    def train_step(self, samples: list[Sample], *, sft: bool = False, value: bool = False,
                   lr: float | None = None) -> StepResult:
        """One optimizer step over the whole batch. With `lr`, that learning rate is used for this
        step only and the schedule does not advance (warm-up stages such as SFT before RL).
        `value` (the value loss) is a critic's step: an actor refuses it."""
        if value:
            raise TrainerStateError("TrainStep: LOSS_KIND_VALUE trains a critic; this trainer is an actor")
        if self.optimizer is None:
            raise TrainerStateError("TrainStep: this trainer was configured eval_only and has no optimizer")
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr: must be a finite number >= 0, got {lr}")
        started = time.perf_counter()
        loss_cfg = self.settings.loss
        if not sft and loss_cfg.kl_coef > 0 and not all(s.ref_logprobs for s in samples):
            raise ValueError("batch: kl_coef > 0 but samples carry no ref_logprobs (call ComputeLogProbs with tag 'ref')")
        was_asleep = self.asleep
        self.use(ACTOR)
        woke_s = time.perf_counter() - started
        self.model.train()
        self._discard_gradients()
        per_token = loss_cfg.loss_agg == "token_mean"
        self._check(samples)
        total = sum(len(s.response_ids) for s in samples) if per_token else len(samples)
        shard = self.dp.shard(len(samples))
        # A rank whose shard is empty still runs one pass at weight 0: every rank then reports
        # the same metric keys and takes part in every collective.
        mine = samples[shard] or samples[:1]
        scale = 1.0 if samples[shard] else 0.0
        sums: dict[str, float] = {}
        for chunk in micro_batches(mine, self.settings.micro_batch_size):
            batch = self._pack(chunk)
            weight = scale * (float(batch.response_mask.sum()) if per_token else len(chunk)) / total
            loss, metrics = self._micro_batch_loss(batch, sft)
            (loss * weight).backward()
            for key, value in metrics.items():
                if key.endswith("_max"):
                    value = value if scale else -math.inf
                    sums[key] = max(sums.get(key, value), value)
                else:
                    sums[key] = sums.get(key, 0.0) + value * weight
        sums = self.dp.combine_metrics(sums)
        sums["grad_norm"] = self._finish_gradients()
        if was_asleep:
            sums["wake_s"] = woke_s
        if not math.isfinite(sums["grad_norm"]):
            # A non-finite gradient would make every weight NaN: skip the step, keep the weights.
            self._discard_gradients()
            sums["step_skipped"] = 1.0
            sums["train_step_s"] = time.perf_counter() - started
            log.warning("step skipped: the gradient norm is %s; weights stay at version %d", sums["grad_norm"],
                        self.weights_version)
            return StepResult(sums, self.weights_version, self.step)
        sums["lr"] = self._apply_gradients(lr)
        if self.device.type == "cuda":  # the step is done when its kernels are: its time, and any error, are this call's
            torch.cuda.synchronize(self.device)
        self.step += 1
        self.weights_version += 1
        self._device_holds = (ACTOR, self.weights_version)
        sums["train_step_s"] = time.perf_counter() - started
        return StepResult(sums, self.weights_version, self.step)

    def _finish_gradients(self) -> float:
        """Complete, reduce and clip this step's gradients; their norm before clipping."""
        self._complete_gradients()
        self.dp.sum_gradients(self.params)
        if self.master is not None:  # the gradients in float32, in a few fused copies
            pairs = [(p.grad, m) for p, m in zip(self.params, self.master) if p.grad is not None]
            for _, m in pairs:
                m.grad = torch.empty_like(m)
            if pairs:
                torch._foreach_copy_([m.grad for _, m in pairs], [g for g, _ in pairs])
        clip = self.settings.optimizer.grad_clip
        return float(self._clip_gradients(self.optimizer_params(), clip if clip > 0 else float("inf")))

    def _discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def _apply_gradients(self, lr: float | None) -> float:
        """Step the optimizer (at `lr` for this step only, when given: the schedule then does not
        advance) and the schedule; the learning rate the step used."""
        scheduled = [group["lr"] for group in self.optimizer.param_groups]
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        used = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        if lr is None:
            self.scheduler.step()
        else:
            for group, value in zip(self.optimizer.param_groups, scheduled):
                group["lr"] = value
        if self.master is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
        return used

    def _complete_gradients(self) -> None:
        """Backends whose ranks hold partial gradients of a shared tensor complete them here."""

    def _clip_gradients(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Scale the gradients of `params` (parallel to self.params) to at most `max_norm`; the norm before."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _micro_batch_loss(self, batch: PackedBatch, sft: bool) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.settings.loss
        logits = self._forward(batch)
        if sft:
            loss = losses.sft_loss(logits, batch.targets, batch.response_mask, cfg.loss_agg)
            return loss, {"loss": loss.item(), "sft_loss": loss.item()}
        logprobs = losses.gather_logprobs(logits, batch.targets)  # [B, T-1]
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        weights, is_metrics = None, {}
        if cfg.correction != "none" and batch.old_logprobs is not None:
            # Off-policy: PPO's ratio against these weights (one optimizer step a batch: the
            # proximal policy is the one computing this), each token scaled by its importance
            # weight against the engine's that sampled it.
            old = logprobs.detach()
            weights, is_metrics = losses.off_policy_weights(old, batch.old_logprobs, batch.response_mask,
                                                            cfg.correction, cfg.is_cap)
        pg_loss, pg_metrics = losses.policy_loss(
            logprobs, old, batch.advantages, batch.response_mask,
            cfg.clip_eps_low, cfg.clip_eps_high, cfg.loss_agg, token_weights=weights,
        )
        loss = pg_loss
        metrics = {"pg_loss": pg_loss.item(), **{k: float(v) for k, v in {**pg_metrics, **is_metrics}.items()}}
        if batch.old_logprobs is not None:
            # The on-policy gap: these weights made the rollout, so any difference is the engine's
            # kernels against the trainer's, token for token.
            metrics.update(losses.logprob_gap(logprobs.detach(), batch.old_logprobs, batch.response_mask))
        if cfg.kl_coef > 0:
            kl = losses.aggregate(
                losses.kl_penalty(logprobs, batch.ref_logprobs, cfg.kl_estimator), batch.response_mask, cfg.loss_agg
            )
            loss = loss + cfg.kl_coef * kl
            metrics["kl"] = kl.item()
        if cfg.entropy_coef != 0:
            entropy = losses.aggregate(losses.entropy_from_logits(logits), batch.response_mask, cfg.loss_agg)
            loss = loss - cfg.entropy_coef * entropy
            metrics["entropy"] = entropy.item()
        metrics["loss"] = loss.item()
        return loss, metrics


def compile_layers(layers, settings) -> None:
    """Each layer's forward through torch.compile, in place (names and parameters unchanged): its
    elementwise work (norms, RoPE, SwiGLU, residuals) fused into a few kernels. One graph serves
    every layer (parameters are its inputs); GPU only, where it pays for its compile time."""
    if settings.compile and torch.device(settings.device).type == "cuda":
        # Megatron's layers warn on every call (a deprecation, from its linears): a warning would
        # split each layer into many small graphs, so it is moved out of the graph instead.
        torch._dynamo.config.reorderable_logging_functions.add(warnings.warn)
        for layer in layers:
            layer.compile(dynamic=None)
