"""The job config tree: one frozen dataclass per component, loaded strictly from YAML.

A job is a tree of small keyword-only dataclasses (rollout, data, reward, eval, algorithm,
trainer, weight sync, checkpoint, sft). Each default lives on its dataclass and nowhere else;
each dataclass checks its own ranges in `__post_init__`, and `JobConfig` checks what spans
components (eval-only jobs, group baselines, scheduler lengths). One generic converter turns
YAML data into the tree, so an unknown key, a wrong type or an out-of-range value anywhere is a
`ConfigError` that names the full dotted field (`eval.datasets[0].sampling.top_p`). `to_dict`
dumps a tree back to plain data with absolute paths (what the coordinator receives as YAML), and
`job_json_schema` derives the JSON Schema published over REST from the same dataclasses.

A mapping given for a nested section overrides that section's default field by field, so
`eval.datasets[].sampling: {max_new_tokens: 128}` stays greedy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import urllib.parse
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import yaml

from services import rpc
from services.coordinator.dataclass_io import (  # noqa: F401 (ConfigError and from_dict are part of this API)
    ConfigError,
    FieldError,
    StrictLoader,
    from_dict,
    json_schema,
    to_dict,
)
from services.coordinator.datasets import Columns, DatasetError, check_dataset

RewardKind = Literal["exact_match", "math_answer", "math_verify", "countdown", "python", "http", "remote"]
AdvantageKind = Literal["grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline", "ppo"]
KlEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
Correction = Literal["none", "tis", "decoupled"]
SchedulerKind = Literal["constant", "linear", "cosine"]
Tag = Literal["ref", "old_actor", "teacher"]
Plane = Literal["auto", "grpc_stream", "broadcast", "shm", "cuda_ipc"]

# Advantage estimators whose baseline is the group of samples drawn for one prompt.
GROUP_BASELINES = ("grpo", "dr_grpo", "reinforce_pp_baseline")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_FUNCTION_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")



def _check(ok: bool, field: str, reason: str) -> None:
    if not ok:
        raise FieldError(field, reason)


# --------------------------------------------------------------------------- the tree


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How a rollout engine samples completions.

    Attributes:
        temperature: softmax temperature; 0 = greedy.
        top_p: nucleus sampling probability mass, in (0, 1].
        top_k: sample among the k most likely tokens; 0 or -1 = all.
        max_new_tokens: completion length limit in tokens.
        stop: strings that end a completion.
        seed: sampling seed; null = not fixed by the config.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be >= 0 (or -1 = all), got {self.top_k}")
        _check(self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True, kw_only=True)
class SglangConfig:
    """An SGLang server per rollout engine (rollout.engine: sglang).

    Attributes:
        url: attach to this running server (http://host:port); null starts one per engine as a
            child of the rollout service (python -m sglang.launch_server, loopback only, with a
            random API key).
        args: extra launch_server arguments, e.g. [--tp, "2", --mem-fraction-static, "0.7"].
        command: the launcher; empty = [python, -m, sglang.launch_server].
        startup_timeout_s: how long a child may take to answer /health_generate.
        memory_saver: --enable-memory-saver and --enable-weights-cpu-backup (colocated jobs).
        request_timeout_s: an HTTP call's timeout (generation included).
    """

    url: str | None = None
    args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    startup_timeout_s: float = 600.0
    memory_saver: bool = False
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("startup_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            _check(value == value and 0 < value <= 86400, name, f"must be seconds in (0, 86400], got {value}")
        _check("--api-key" not in self.args, "args", "--api-key is set by rlfleet (a random key per child)")

    @property
    def local(self) -> bool:
        """Started by the rollout service, or attached over loopback (a sidecar in the pod)."""
        return self.url is None or rpc.is_loopback(urllib.parse.urlsplit(self.url).hostname or "")

    @property
    def tp_size(self) -> int:
        """SGLang's tensor-parallel ranks per engine (--tp in args; 1 by default)."""
        for flag in ("--tp", "--tp-size", "--tensor-parallel-size"):
            if flag in self.args and self.args.index(flag) + 1 < len(self.args):
                return int(self.args[self.args.index(flag) + 1])
        return 1


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    """Groups whose samples all got the same reward teach a group baseline nothing (every
    advantage is 0): they are dropped and more prompts generated in their place, as DAPO does.

    Attributes:
        max_rounds: generation rounds a step may add to refill its prompts_per_step groups; a step
            that still has fewer trains on those it has.
    """

    max_rounds: int = 3

    def __post_init__(self) -> None:
        _check(1 <= self.max_rounds <= 64, "max_rounds", f"must be in [1, 64], got {self.max_rounds}")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """What the rollout fleet generates each RL step.

    Attributes:
        prompts_per_step: prompts drawn from data.train per step.
        samples_per_prompt: completions sampled per prompt (the group size of group baselines).
        sampling: sampling parameters for training rollouts.
        num_engines: rollout engines to run.
        elastic: the job also takes rollout engines that become ready while it runs (the rollout
            StatefulSet scaled up, or a coordinator's ScaleEngines call), each admitted at a step
            boundary once it has taken and verified the current weights, and stops sending work
            to engines no longer listed. num_engines is then the count it starts with. Leave it
            off where several jobs share a coordinator's engines.
        devices: where the engines run (cpu, cuda or cuda:N), taken in turn: engine k gets
            devices[k % len(devices)]; empty = the trainer's device. [cuda:1] puts every engine
            on GPU 1 beside a trainer on GPU 0, and weights then move by NCCL broadcast.
        max_batch_size: rows an engine decodes together (continuous batching fills freed rows).
        kv_cache_fraction: share of the GPU memory free when an engine first generates that its
            KV cache takes (like other engines' memory-utilisation setting); the cache and the
            decode graphs are freed whenever the engine releases its memory (colocate).
        cuda_graphs: replay each decode step as a captured CUDA graph (GPU engines).
        prefix_cache: built-in engines keep the KV blocks of prompts' full 16-token blocks and
            reuse them for later prompts that start the same way, under the same weights (a
            weight update empties the cache): a system prompt or a multi-turn history is
            prefilled once.
        engine: torch (the built-in engine) or sglang (an SGLang server per engine, driven over
            its HTTP API; weights reach it by broadcast, or by CUDA IPC on the trainer's GPU).
        sglang: the SGLang servers (engine sglang).
        dynamic_sampling: drop groups whose rewards are all equal and generate more prompts in
            their place (see DynamicSamplingConfig); absent: every group is trained on.
    """

    prompts_per_step: int = 16
    samples_per_prompt: int = 8
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    num_engines: int = 1
    elastic: bool = False
    devices: tuple[str, ...] = ()
    max_batch_size: int = 256
    kv_cache_fraction: float = 0.5
    cuda_graphs: bool = True
    prefix_cache: bool = False
    engine: Literal["torch", "sglang"] = "torch"
    sglang: SglangConfig = field(default_factory=SglangConfig)
    dynamic_sampling: DynamicSamplingConfig | None = None

    def __post_init__(self) -> None:
        _check(self.prompts_per_step >= 1, "prompts_per_step", f"must be >= 1, got {self.prompts_per_step}")
        _check(self.samples_per_prompt >= 1, "samples_per_prompt", f"must be >= 1, got {self.samples_per_prompt}")
        _check(self.num_engines >= 1, "num_engines", f"must be >= 1, got {self.num_engines}")
        _check(1 <= self.max_batch_size <= 4096, "max_batch_size",  # the engines' own bound
               f"must be in [1, 4096], got {self.max_batch_size}")
        _check(0 < self.kv_cache_fraction <= 0.95, "kv_cache_fraction", f"must be in (0, 0.95], got {self.kv_cache_fraction}")
        for device in self.devices:
            _check(bool(_DEVICE_RE.fullmatch(device)), "devices", f"expected cpu, cuda or cuda:N, got {device!r}")

    def device_of(self, engine: int, default: str) -> str:
        """The device engine `engine` runs on (`default`: the trainer's)."""
        return self.devices[engine % len(self.devices)] if self.devices else default


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training prompts: rows with a prompt (or a conversation) and an answer.

    Every dataset path of the job (data.train, eval.datasets[].path, sft.data) may be a JSON-lines
    file, a Parquet file (.parquet, .pq) or a folder written by Hugging Face datasets'
    save_to_disk; all are read with the keys below.

    Attributes:
        train: training rows; required unless the job is eval-only.
        prompt_key: key of the prompt (a non-empty string) in each row; not read when messages_key is set.
        answer_key: key of the reference answer (a string or a number) in each row.
        messages_key: key of a conversation to use as the prompt instead: a list of {role,
            content} turns (system first if at all, user and assistant, a user turn last),
            rendered with the model's chat template; null = rows have a prompt.
        metadata_keys: keys copied from each row into the metadata the reward receives.
        shuffle: reshuffle the rows every epoch (deterministically from the job seed).
    """

    train: Path | None = None
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    messages_key: str | None = None
    metadata_keys: tuple[str, ...] = ()
    shuffle: bool = True

    def __post_init__(self) -> None:
        _check(bool(self.prompt_key), "prompt_key", "must not be empty")
        _check(bool(self.answer_key), "answer_key", "must not be empty")
        _check(self.messages_key is None or bool(self.messages_key), "messages_key", "must not be empty (null = rows have a prompt)")
        _check(all(self.metadata_keys), "metadata_keys", "must not contain an empty key")
        repeated = sorted({k for k in self.metadata_keys if self.metadata_keys.count(k) > 1})
        _check(not repeated, "metadata_keys", f"must not repeat a key, repeated: {', '.join(repeated)}")

    @property
    def columns(self) -> Columns:
        """What the dataset readers take from each row."""
        return Columns(prompt_key=self.prompt_key, answer_key=self.answer_key,
                       messages_key=self.messages_key, metadata_keys=self.metadata_keys)


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """How a completion is scored against the reference answer.

    Attributes:
        kind: exact_match, math_answer, math_verify (math_answer, then Hugging Face's math-verify
            for equivalent forms; needs the math-verify package), countdown, python (a
            module:function), http (a POST endpoint) or remote (the Score call of an environment
            server, rlfleet.v1.Environment: a reward model or a verifier as a service).
        function: "module:function" to import when kind is python.
        url: endpoint to POST {prompt, completion, answer, metadata} to when kind is http.
        address: host:port of the environment server when kind is remote (the coordinator's
            worker token and TLS apply).
        timeout_s: per-request timeout when kind is http or remote; time limit per answer when
            kind is math_verify (past it the answer scores 0 and its checker process is replaced).
    """

    kind: RewardKind = "exact_match"
    function: str | None = None
    url: str | None = None
    address: str | None = None
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.kind == "python":
            _check(self.function is not None, "function", "required when kind is 'python' (\"module:function\")")
            _check(
                bool(_FUNCTION_RE.fullmatch(self.function or "")),
                "function", f"expected \"module:function\", got {self.function!r}",
            )
        else:
            _check(self.function is None, "function", f"only used when kind is 'python' (kind is {self.kind!r})")
        if self.kind == "http":
            _check(self.url is not None, "url", "required when kind is 'http'")
            _check(
                (self.url or "").startswith(("http://", "https://")),
                "url", f"expected an http:// or https:// URL, got {self.url!r}",
            )
        else:
            _check(self.url is None, "url", f"only used when kind is 'http' (kind is {self.kind!r})")
        if self.kind == "remote":
            _check(bool(re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", self.address or "")), "address",
                   f"kind remote needs host:port, got {self.address!r}")
        else:
            _check(self.address is None, "address", f"only used when kind is 'remote' (kind is {self.kind!r})")
        _check(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class EvalDatasetConfig:
    """One evaluation set; its score is the mean reward over its rows.

    Attributes:
        name: label of the results (unique within the job).
        path: JSON-lines file, Parquet file or datasets folder, read with data's keys.
        limit: evaluate only the first rows of the file; null = all rows.
        reward: how to score this set; null = the job's reward (filled in when the job is loaded).
        sampling: sampling for this set; fields left out keep the greedy default.
    """

    name: str
    path: Path
    limit: int | None = None
    reward: RewardConfig | None = None
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(temperature=0.0))

    def __post_init__(self) -> None:
        _check(bool(self.name), "name", "must not be empty")
        _check(self.limit is None or self.limit >= 1, "limit", f"must be >= 1 or null, got {self.limit}")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """When and on what the policy is evaluated.

    Attributes:
        every: evaluate every this many RL steps; 0 = only before the first and after the last step.
        datasets: evaluation sets.
        overlap: with algorithm.async, an eval between steps runs beside the next step's training
            instead of before it. It stays pinned to its step's weights: the next weight sync
            waits for it (docs/async.md). Ignored by the synchronous loop.
    """

    every: int = 10
    datasets: tuple[EvalDatasetConfig, ...] = ()
    overlap: bool = True

    def __post_init__(self) -> None:
        _check(self.every >= 0, "every", f"must be >= 0, got {self.every}")
        names = [d.name for d in self.datasets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        _check(not duplicates, "datasets", f"dataset names must be unique, repeated: {', '.join(duplicates)}")


@dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """Asynchronous RL: the engines generate the coming steps' samples while the trainer trains on
    finished ones (docs/async.md).

    Attributes:
        max_staleness: how many weight versions a trained sample may be behind the trainer, for
            its oldest token; 0 is the synchronous loop. Generation for a step starts only once
            the trainer is that close, so engines run at most max_staleness steps ahead.
        correction: off-policy correction against the engine's logprobs: tis (truncated
            importance sampling, as verl and slime), decoupled (decoupled PPO, as AReaL) or none
            (PPO's ratio against the engine's logprobs).
        tis_cap: tis: importance weights are truncated at this; decoupled: tokens whose weight
            is above it are left out (0: none left out).
        partial: true: a weight update reaches engines while they generate (the pause policy):
            rows go on under the new weights, their tokens keeping the versions that sampled
            them; false: updates wait for the requests running to finish (drain), so each
            sample comes from one version.
    """

    max_staleness: int = 1
    correction: Correction = "tis"
    tis_cap: float = 2.0
    partial: bool = True

    def __post_init__(self) -> None:
        _check(0 <= self.max_staleness <= 64, "max_staleness", f"must be in [0, 64], got {self.max_staleness}")
        if self.correction == "tis":
            _check(self.tis_cap > 0, "tis_cap", f"must be > 0 for correction tis, got {self.tis_cap}")
        _check(self.tis_cap >= 0, "tis_cap", f"must be >= 0, got {self.tis_cap}")


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The RL objective: advantage estimator and loss terms.

    Attributes:
        advantage: grpo, dr_grpo, reinforce_pp, reinforce_pp_baseline or ppo (GAE over a learned value
            function: the job runs critics, see `critic`).
        normalize_std: divide GRPO advantages by the group's standard deviation (grpo only).
        kl_coef: weight of the KL penalty against the reference model; > 0 loads a ref copy.
        kl_estimator: k1, k2, k3 or low_var_kl (k3 clamped to [-10, 10]).
        use_kl_loss: true = KL is a loss term (kl_estimator); false = kl_coef * sum_t (logp - ref_logp)
            (the k1 estimate) is subtracted from each completion's reward before advantages.
        clip_eps_low: PPO ratio clip below 1 (ratio >= 1 - clip_eps_low).
        clip_eps_high: PPO ratio clip above 1 (ratio <= 1 + clip_eps_high).
        entropy_coef: weight of the entropy bonus.
        loss_agg: token_mean, seq_mean_token_sum or seq_mean_token_mean.
        gamma: ppo: discount per token in GAE, in [0, 1].
        lam: ppo: GAE's lambda (bias-variance trade-off of the advantage), in [0, 1].
        whiten_advantages: ppo: scale the token advantages of each step to mean 0, std 1.
        async: asynchronous RL (see AsyncConfig); absent: the synchronous loop.
    """

    advantage: AdvantageKind = "grpo"
    normalize_std: bool = True
    kl_coef: float = 0.0
    kl_estimator: KlEstimator = "low_var_kl"
    use_kl_loss: bool = True
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    entropy_coef: float = 0.0
    loss_agg: LossAgg = "token_mean"
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    async_: AsyncConfig | None = None

    def __post_init__(self) -> None:
        _check(self.kl_coef >= 0, "kl_coef", f"must be >= 0, got {self.kl_coef}")
        _check(0 <= self.gamma <= 1, "gamma", f"must be in [0, 1], got {self.gamma}")
        _check(0 <= self.lam <= 1, "lam", f"must be in [0, 1], got {self.lam}")
        # 1 - clip_eps_low <= 0 would clip the ratio to a non-positive value: no lower clip at all.
        _check(0 <= self.clip_eps_low < 1, "clip_eps_low", f"must be in [0, 1), got {self.clip_eps_low}")
        _check(self.clip_eps_high >= 0, "clip_eps_high", f"must be >= 0, got {self.clip_eps_high}")

    @property
    def needs_ref(self) -> bool:
        return self.kl_coef > 0

    @property
    def max_staleness(self) -> int:
        """Versions a trained sample may lag the trainer by (0: the synchronous loop)."""
        return self.async_.max_staleness if self.async_ is not None else 0


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW settings.

    Attributes:
        lr: peak learning rate.
        weight_decay: decoupled weight decay.
        betas: Adam beta1 and beta2, each in [0, 1).
        eps: Adam epsilon.
        grad_clip: clip the global gradient norm to this; 0 = no clipping.
    """

    lr: float = 1.0e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _check(all(0 <= b < 1 for b in self.betas), "betas", f"each must be in [0, 1), got {list(self.betas)}")
        _check(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        _check(self.grad_clip >= 0, "grad_clip", f"must be >= 0 (0 = no clipping), got {self.grad_clip}")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Learning-rate schedule: linear warmup, then constant, linear or cosine decay.

    Attributes:
        kind: constant, linear or cosine.
        warmup_steps: steps of linear warmup from 0 to lr.
        decay_steps: steps until the rate reaches lr * min_lr_ratio; null = num_rollout.
        min_lr_ratio: final rate as a fraction of lr, in [0, 1].
    """

    kind: SchedulerKind = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        _check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _check(
            self.decay_steps is None or self.decay_steps >= 0,
            "decay_steps", f"must be >= 0 or null, got {self.decay_steps}",
        )
        _check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")

    def total_decay_steps(self, num_rollout: int) -> int:
        """decay_steps with its null default resolved against the job's number of RL steps."""
        return num_rollout if self.decay_steps is None else self.decay_steps


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The trainer fleet: backend, placement, precision, optimizer and memory lifecycle.

    Attributes:
        backend: torch (every rank holds the whole model: data parallel) or megatron (Megatron-core
            GPTModel split over tensor_parallel x pipeline_parallel ranks, data parallel beyond).
        device: cpu, cuda or cuda:N.
        dtype: parameter dtype: float32, bfloat16 or float16.
        num_trainers: trainer ranks (one process each), all training one model.
        tensor_parallel: megatron: ranks that split every layer (divides num_trainers).
        pipeline_parallel: megatron: ranks that split the layers (tensor_parallel x
            pipeline_parallel divides num_trainers).
        micro_batch_size: sequences per forward/backward pass; gradients accumulate over a step.
        optimizer: AdamW settings.
        scheduler: learning-rate schedule.
        offload: move weights and optimizer state to host memory between steps.
        colocate: trainers share GPUs with rollout engines (sleep while engines generate).
        master_weights: null (parameters are the master copy) or fp32.
        tags: extra model copies to keep: ref, old_actor, teacher (ref is added when kl_coef > 0).
        compile: on GPUs, run each decoder layer through torch.compile (fused norms, RoPE and
            SwiGLU: 1.5B trains about 25% faster on an H200; the first step compiles for ~10 s).
    """

    backend: Literal["torch", "megatron"] = "torch"
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    num_trainers: int = 1
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    micro_batch_size: int = 64
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    offload: bool = False
    colocate: bool = False
    master_weights: Literal["fp32"] | None = None
    tags: tuple[Tag, ...] = ()
    compile: bool = True

    def __post_init__(self) -> None:
        _check(bool(_DEVICE_RE.fullmatch(self.device)), "device", f"expected cpu, cuda or cuda:N, got {self.device!r}")
        _check(self.num_trainers >= 1, "num_trainers", f"must be >= 1, got {self.num_trainers}")
        for name in ("tensor_parallel", "pipeline_parallel"):
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
            _check(self.backend == "megatron" or getattr(self, name) == 1, name,
                   "only the megatron backend splits the model (the torch backend is data parallel)")
        split = self.tensor_parallel * self.pipeline_parallel
        _check(self.num_trainers % split == 0, "num_trainers",
               f"{self.num_trainers} ranks cannot hold tensor_parallel x pipeline_parallel = {split} model shards")
        _check(self.micro_batch_size >= 1, "micro_batch_size", f"must be >= 1, got {self.micro_batch_size}")
        _check(len(set(self.tags)) == len(self.tags), "tags", f"must not repeat a tag, got {list(self.tags)}")


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """PPO's value model: trainer processes configured as critics (only `advantage: ppo` runs them,
    and an eval-only job never does).

    Attributes:
        model: the critic's starting point: null = the policy's `model` (its backbone, and a value
            head at zero), or a critic checkpoint folder (a policy folder plus value_head.safetensors).
        num_critics: critic ranks (one process each), all training one value model (data parallel).
        device: null = trainer.device.
        dtype: null = trainer.dtype.
        micro_batch_size: null = trainer.micro_batch_size.
        optimizer: the critic's own AdamW settings.
        scheduler: the critic's own learning-rate schedule.
        value_clip: new values stay within the old values +- value_clip in the loss; 0 = no clipping.
        warmup_steps: the first RL steps train the critic alone; the policy starts moving after them.
        offload: null = trainer.offload (an offloaded critic sleeps whenever it is not computing).
    """

    model: Path | None = None
    num_critics: int = 1
    device: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    micro_batch_size: int | None = None
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1.0e-5))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    value_clip: float = 0.2
    warmup_steps: int = 0
    offload: bool | None = None

    def __post_init__(self) -> None:
        _check(self.num_critics >= 1, "num_critics", f"must be >= 1, got {self.num_critics}")
        _check(self.device is None or bool(_DEVICE_RE.fullmatch(self.device)), "device",
               f"expected cpu, cuda or cuda:N, got {self.device!r}")
        _check(self.micro_batch_size is None or self.micro_batch_size >= 1, "micro_batch_size",
               f"must be >= 1, got {self.micro_batch_size}")
        _check(self.value_clip >= 0, "value_clip", f"must be >= 0 (0 = no clipping), got {self.value_clip}")
        _check(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True, kw_only=True)
class WeightSyncConfig:
    """How new weights travel from trainers to rollout engines after each step.

    Attributes:
        plane: auto (chosen per engine), grpc_stream, broadcast, shm or cuda_ipc.
        verify: fingerprint (cheap per-bucket checksum) or exact (full comparison).
        bucket_mb: size of the flat buckets weights are packed into, in MiB.
        timeout_s: give up on a sync (and drop the engine from the pool) after this long.
    """

    plane: Plane = "auto"
    verify: Literal["fingerprint", "exact"] = "fingerprint"
    bucket_mb: int = 512
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _check(self.bucket_mb >= 1, "bucket_mb", f"must be >= 1, got {self.bucket_mb}")
        _check(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")

    @property
    def bucket_bytes(self) -> int:
        return self.bucket_mb * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Periodic checkpoints of the policy (and optimizer state) for resuming.

    Attributes:
        every: save every this many RL steps and after the last one; 0 = never.
        dir: where checkpoints go; null = <output_dir>/checkpoints.
    """

    every: int = 0
    dir: Path | None = None

    def __post_init__(self) -> None:
        _check(self.every >= 0, "every", f"must be >= 0, got {self.every}")


@dataclass(frozen=True, kw_only=True)
class SftConfig:
    """An optional supervised warm-up stage run before RL, on prompt/answer pairs.

    Attributes:
        data: prompt/answer rows (JSON lines, Parquet or a datasets folder, read with data's keys).
        steps: optimizer steps of SFT.
        batch_size: rows per SFT step.
        lr: learning rate of the SFT stage (constant).
        conversations: rows are whole conversations under data.messages_key (tool turns
            allowed, ending with an assistant turn), rendered with the model's chat template;
            the loss is on the assistant turns only. Agent jobs warm up on trajectories so.
    """

    data: Path
    steps: int
    batch_size: int = 8
    lr: float = 1.0e-5
    conversations: bool = False

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
        _check(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        _check(self.lr > 0, "lr", f"must be > 0, got {self.lr}")


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """A Weights & Biases run per job (needs the wandb package).

    Attributes:
        project: W&B project name.
        mode: offline (files under <dir>/wandb, no network; `wandb sync` uploads them later) or online.
        entity: W&B team or user; null = the default of the logged-in account.
        name: run name; null = <job name>-<job id>.
        group: run group; null = none.
        tags: run tags.
        dir: where the wandb folder goes; null = the job's output directory.
    """

    project: str
    mode: Literal["offline", "online"] = "offline"
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()
    dir: Path | None = None

    def __post_init__(self) -> None:
        _check(bool(self.project), "project", "must not be empty")


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Experiment trackers that receive step metrics, eval scores and weight-sync stats, beside
    the metrics.jsonl, eval.jsonl and reward_curve.png every job writes.

    Attributes:
        tensorboard: write TensorBoard event files to <output_dir>/tensorboard (needs tensorboard).
        wandb: log to Weights & Biases; null = off.
    """

    tensorboard: bool = False
    wandb: WandbConfig | None = None


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Multi-turn episodes: the model acts in an environment over several turns
    (docs/agents.md). Absent: one completion per sample, scored by `reward`.

    Attributes:
        environment: calculator (tool calls in the Hermes / Qwen <tool_call> format answered by
            an arithmetic evaluator; the final answer is scored by exact match against the row's
            answer), or python (the calculator and a python tool: {"code": ...} run in a
            sandboxed child process, services/coordinator/sandbox.py), or remote (the episodes run
            on an environment server at `address`, `rlfleet.v1.Environment`).
        address: remote: host:port of the environment server (the coordinator's worker token
            and TLS apply).
        timeout_s: remote: seconds each Reset or Step may take; an episode whose call fails or
            times out is dropped with its group and counted, never scored.
        max_observation_bytes: remote: the largest reply taken; a larger one fails its episode.
        max_turns: assistant turns an episode may take; one still going then scores 0.
        max_tokens: prompt, turns and observations an episode may hold, in tokens.
        max_tool_calls: tool calls an episode may make; the turn after the last must answer.
        observation_role: with chat prompts (data.messages_key), each observation is appended as
            a message of this role in the model's chat template (its end-of-turn, header and the
            next assistant header around it); without, as its own text.
    """

    environment: Literal["calculator", "python", "remote"] = "calculator"
    max_turns: int = 4
    max_tokens: int = 512
    max_tool_calls: int = 3
    address: str = ""
    timeout_s: float = 30.0
    max_observation_bytes: int = 1 << 20
    observation_role: str = "tool"

    def __post_init__(self) -> None:
        _check(bool(re.fullmatch(r"[a-z_]{1,32}", self.observation_role)), "observation_role",
               f"must be a role name such as tool or user, got {self.observation_role!r}")
        _check(1 <= self.max_turns <= 64, "max_turns", f"must be in [1, 64], got {self.max_turns}")
        _check(2 <= self.max_tokens <= 1 << 20, "max_tokens", f"must be in [2, 1048576], got {self.max_tokens}")
        _check(0 <= self.max_tool_calls <= 64, "max_tool_calls", f"must be in [0, 64], got {self.max_tool_calls}")
        _check(self.environment != "remote" or bool(re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", self.address)),
               "address", f"environment remote needs host:port, got {self.address!r}")
        _check(0 < self.timeout_s <= 3600, "timeout_s", f"must be in (0, 3600], got {self.timeout_s}")
        _check(1024 <= self.max_observation_bytes <= 64 << 20, "max_observation_bytes",
               f"must be in [1024, 67108864], got {self.max_observation_bytes}")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """One RL post-training job (or, with num_rollout 0, one evaluation of a checkpoint).

    Attributes:
        name: job name: letters, digits, '.', '_' and '-', at most 63 characters.
        seed: seed for data order, sampling and initialisation.
        model: Hugging Face model directory (config.json, tokenizer.json, *.safetensors).
        num_rollout: RL steps to run; 0 = eval-only job.
        output_dir: where metrics, plots and checkpoints go; null = <cwd>/runs/<name>-<YYYYmmdd-HHMMSS>.
        rollout: what the rollout fleet generates each step.
        data: training prompts.
        reward: how completions are scored.
        eval: evaluation schedule and datasets.
        algorithm: advantage estimator and loss terms.
        trainer: trainer fleet, optimizer and scheduler.
        critic: PPO's value model (used only with algorithm.advantage ppo).
        weight_sync: how weights reach the rollout engines.
        checkpoint: periodic checkpoints.
        sft: optional supervised warm-up stage before RL; null = none.
        tracking: optional experiment trackers (TensorBoard, W&B).
        agent: multi-turn episodes in an environment (see AgentConfig); null = single-turn.
    """

    name: str
    seed: int = 1
    model: Path
    num_rollout: int
    output_dir: Path | None = None
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    sft: SftConfig | None = None
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    agent: AgentConfig | None = None

    def __post_init__(self) -> None:
        _check(
            bool(_NAME_RE.fullmatch(self.name)), "name",
            f"use letters, digits, '.', '_' and '-' (at most 63, starting with a letter or digit), got {self.name!r}",
        )
        if any(d.reward is None for d in self.eval.datasets):
            # Resolve "null = the job's reward" once, here, so readers (and the wire form) see it explicitly.
            datasets = tuple(dataclasses.replace(d, reward=d.reward or self.reward) for d in self.eval.datasets)
            object.__setattr__(self, "eval", dataclasses.replace(self.eval, datasets=datasets))
        _check(self.num_rollout >= 0, "num_rollout", f"must be >= 0 (0 = eval-only job), got {self.num_rollout}")
        if self.eval_only:
            _check(
                bool(self.eval.datasets), "eval.datasets",
                "an eval-only job (num_rollout: 0) needs at least one eval dataset",
            )
            _check(self.sft is None, "sft", "an eval-only job (num_rollout: 0) does not train; remove sft")
            return  # nothing below is built when no step trains (no optimizer, no scheduler)
        _check(
            self.data.train is not None, "data.train",
            "a training job (num_rollout > 0) needs a training dataset (or set num_rollout: 0 for eval-only)",
        )
        _check(self.sft is None or not self.sft.conversations or self.data.messages_key is not None,
               "sft.conversations", "needs data.messages_key: the key of each row's conversation")
        advantage = self.algorithm.advantage
        if self.needs_critic:
            _check(self.critic.warmup_steps < self.num_rollout, "critic.warmup_steps",
                   f"must be < num_rollout ({self.num_rollout}), or the policy never trains; got {self.critic.warmup_steps}")
            critic_sched = self.critic.scheduler
            if critic_sched.kind != "constant":
                _check(critic_sched.warmup_steps < critic_sched.total_decay_steps(self.num_rollout),
                       "critic.scheduler.warmup_steps", f"must be < the decay steps of a {critic_sched.kind} scheduler")
        if self.algorithm.max_staleness > 0:
            _check(not self.trainer.colocate, "algorithm.async",
                   "asynchronous RL keeps engines generating while the trainer trains: it needs separate "
                   "devices (trainer.colocate shares one; remove one of them)")
            _check(not self.needs_critic, "algorithm.async",
                   "asynchronous RL is not built for PPO's critic yet (use a group baseline: grpo, dr_grpo, ...)")
        if self.rollout.dynamic_sampling is not None:
            _check(self.rollout.samples_per_prompt >= 2, "rollout.dynamic_sampling",
                   "needs samples_per_prompt >= 2: a group of one sample always has one reward")
        if advantage in GROUP_BASELINES:
            _check(
                self.rollout.samples_per_prompt >= 2, "rollout.samples_per_prompt",
                f"must be >= 2 for algorithm.advantage {advantage!r}, whose baseline is the group of "
                f"samples of one prompt; got {self.rollout.samples_per_prompt}",
            )
        if self.rollout.engine == "sglang":
            tp = self.rollout.sglang.tp_size
            _check(self.weight_sync.verify != "exact" or tp == 1, "weight_sync.verify",
                   f"exact verification reads weights back through SGLang's /get_weights_by_name, which with --tp {tp} "
                   "returns only rank 0's shard of most weights (use fingerprint)")
            _check(self.weight_sync.plane in ("auto", "broadcast", "cuda_ipc"), "weight_sync.plane",
                   f"SGLang engines take weights by broadcast or, on the trainer's GPU, by cuda_ipc; got "
                   f"{self.weight_sync.plane}")
            _check(self.weight_sync.plane != "cuda_ipc" or (tp == 1 and self.rollout.sglang.local), "weight_sync.plane",
                   "cuda_ipc hands SGLang CUDA IPC handles in a pickle: only to an SGLang on the engine's host, "
                   "reached over loopback (started by rlfleet, or a sidecar), with one rank (--tp 1)")
        scheduler = self.trainer.scheduler
        if scheduler.kind != "constant":
            decay_steps = scheduler.total_decay_steps(self.num_rollout)
            source = "num_rollout" if scheduler.decay_steps is None else "trainer.scheduler.decay_steps"
            _check(
                scheduler.warmup_steps < decay_steps, "trainer.scheduler.warmup_steps",
                f"must be < the decay steps of a {scheduler.kind} scheduler ({source} = {decay_steps}), "
                f"got {scheduler.warmup_steps}",
            )

    @property
    def eval_only(self) -> bool:
        return self.num_rollout == 0

    @property
    def needs_critic(self) -> bool:
        """PPO trains a value model; an eval-only job builds none, whatever its algorithm says."""
        return self.algorithm.advantage == "ppo" and not self.eval_only

    @property
    def num_critics(self) -> int:
        return self.critic.num_critics if self.needs_critic else 0

    @property
    def critic_offload(self) -> bool:
        """Whether critics sleep between their turns: critic.offload, or the trainer's when unset."""
        return self.trainer.offload if self.critic.offload is None else self.critic.offload

    @property
    def rewards(self) -> list[RewardConfig]:
        """Every reward the job scores with: its own and those eval datasets set for themselves."""
        return [self.reward, *(d.reward for d in self.eval.datasets if d.reward)]

    @property
    def trainer_tags(self) -> tuple[str, ...]:
        """The copies trainers keep: trainer.tags plus ref when the KL penalty needs it (none when eval-only)."""
        if self.eval_only:
            return ()
        tags = list(self.trainer.tags)
        if self.algorithm.needs_ref and "ref" not in tags:
            tags.append("ref")
        return tuple(tags)


def load_job(path: str | Path, *, check_files: bool = True) -> JobConfig:
    """Read a job YAML file; relative paths in it are resolved against the file's directory."""
    path = Path(path).expanduser().absolute()
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read job config {path}: {e.strerror or e}") from e
    try:
        return parse_job(text, path.parent, check_files=check_files)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e


def parse_job(text: str, base_dir: str | Path, *, check_files: bool = True) -> JobConfig:
    """Parse job YAML text; relative paths are resolved against base_dir.

    With check_files the files the job will read must exist (model directory with config.json,
    data.train when training, eval datasets, sft data); a coordinator that validates a job for
    pods with other volumes passes check_files=False.
    """
    try:
        data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"invalid YAML: {e}") from e
    if data is None:
        raise ConfigError("the job config is empty")
    cfg = from_dict(JobConfig, data, base_dir=base_dir)
    if check_files:
        check_packages(cfg)
        check_paths(cfg)
    return cfg


# --------------------------------------------------------------------------- after loading


def check_paths(cfg: JobConfig) -> None:
    """Raise ConfigError naming the field when a file the job will read does not exist."""
    if not cfg.model.is_dir():
        what = "does not exist" if not cfg.model.exists() else "is not a directory"
        raise ConfigError(f"model: {cfg.model} {what} (expected a Hugging Face model directory)")
    if not (cfg.model / "config.json").is_file():
        raise ConfigError(f"model: {cfg.model} has no config.json (expected a Hugging Face model directory)")
    if cfg.needs_critic and cfg.critic.model is not None and not (cfg.critic.model / "config.json").is_file():
        raise ConfigError(f"critic.model: {cfg.critic.model} has no config.json (expected a critic checkpoint or "
                          "a Hugging Face model directory)")
    files: list[tuple[str, Path]] = [(f"eval.datasets[{i}].path", d.path) for i, d in enumerate(cfg.eval.datasets)]
    if not cfg.eval_only:
        assert cfg.data.train is not None  # JobConfig checks this for training jobs
        files.insert(0, ("data.train", cfg.data.train))
        if cfg.sft is not None:
            files.append(("sft.data", cfg.sft.data))
    for name, file in files:
        if not file.exists():
            raise ConfigError(f"{name}: {file} does not exist")
        if not (file.is_file() or file.is_dir()):
            raise ConfigError(f"{name}: {file} is not a file or a datasets folder")
    # Every row is read now (streamed, none kept), not after the services start: an empty file
    # or a bad row fails the submit (exit 2), naming the field, the file and the line or row.
    limits = {f"eval.datasets[{i}].path": d.limit for i, d in enumerate(cfg.eval.datasets)}
    sft_columns = dataclasses.replace(cfg.data.columns, trajectories=True) if cfg.sft and cfg.sft.conversations else None
    for name, file in files:
        try:
            columns = sft_columns if name == "sft.data" and sft_columns else cfg.data.columns
            check_dataset(file, columns, limit=limits.get(name))
        except DatasetError as e:
            raise ConfigError(f"{name}: {e}") from e


def check_packages(cfg: JobConfig) -> None:
    """ConfigError naming the field and the package when an optional package the job uses is not
    installed where the job runs (the coordinator scores rewards and writes trackers itself)."""
    needs = [("reward.kind" if i == 0 else f"eval.datasets[{i - 1}].reward.kind", "math_verify", "math-verify")
             for i, r in enumerate([cfg.reward, *(d.reward for d in cfg.eval.datasets)])
             if r is not None and r.kind == "math_verify"]
    paths = [("data.train", cfg.data.train), ("sft.data", cfg.sft.data if cfg.sft else None),
             *((f"eval.datasets[{i}].path", d.path) for i, d in enumerate(cfg.eval.datasets))]
    needs += [(name, "pyarrow", "pyarrow") for name, path in paths
              if path is not None and (path.is_dir() or path.suffix.lower() in (".parquet", ".pq"))]
    if cfg.tracking.tensorboard:
        needs.append(("tracking.tensorboard", "tensorboard", "tensorboard"))
    if cfg.tracking.wandb is not None:
        needs.append(("tracking.wandb", "wandb", "wandb"))
    for name, module, package in needs:
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"{name}: needs the {package} package, which is not installed on this "
                              f"coordinator (pip install {package})")


def resolve_output_dir(cfg: JobConfig, *, cwd: Path, now: datetime) -> Path:
    """output_dir, or its default <cwd>/runs/<name>-<YYYYmmdd-HHMMSS> for a job started at `now`."""
    if cfg.output_dir is not None:
        return cfg.output_dir
    return Path(cwd).absolute() / "runs" / f"{cfg.name}-{now:%Y%m%d-%H%M%S}"



def to_yaml(cfg: JobConfig) -> str:
    """The YAML form of `to_dict(cfg)`, in field order; `parse_job` reads it back to an equal config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# --------------------------------------------------------------------------- JSON Schema


def job_json_schema() -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) for job configs, derived from the dataclasses."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "rlfleet job", **json_schema(JobConfig)}


