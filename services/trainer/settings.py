"""The trainer's own configuration: what one trainer rank needs to build its model and optimizer.

The coordinator sends it as `rlfleet.v1.TrainerConfig`; the servicer turns that into this frozen
dataclass, and only the trainer reads it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services import devices
from services.models.decoder import torch_dtype
from services.trainer.losses import CORRECTIONS

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
SCHEDULER_KINDS = ("constant", "linear", "cosine")
TAGS = ("ref", "old_actor", "teacher")
BACKENDS = ("torch", "megatron")
ROLES = ("actor", "critic")


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _finite("optimizer.lr", self.lr, low=0.0)
        _finite("optimizer.weight_decay", self.weight_decay, low=0.0)
        _finite("optimizer.beta1", self.beta1, low=0.0, below=1.0)
        _finite("optimizer.beta2", self.beta2, low=0.0, below=1.0)
        _finite("optimizer.eps", self.eps, low=0.0, open_low=True)
        _finite("optimizer.grad_clip", self.grad_clip, low=0.0)


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings:
    kind: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("scheduler.warmup_steps, scheduler.decay_steps: must be >= 0")
        _finite("scheduler.min_lr_ratio", self.min_lr_ratio, low=0.0, high=1.0)

    def check_decay(self) -> None:
        """A decaying schedule must end its decay after its warm-up. Checked when an optimizer is
        built, never in eval-only, which reads no schedule settings."""
        if self.kind != "constant" and self.decay_steps <= self.warmup_steps:
            raise ValueError(
                f"scheduler.decay_steps ({self.decay_steps}) must be larger than scheduler.warmup_steps "
                f"({self.warmup_steps}) for a {self.kind} schedule"
            )

@dataclass(frozen=True, kw_only=True)
class LossSettings:
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    entropy_coef: float = 0.0
    loss_agg: str = "token_mean"
    value_clip: float = 0.2  # critic: new values stay within old_values +- value_clip (0: unclipped)
    # Off-policy correction against the engine's logprobs (`losses.off_policy_weights`): "none"
    # takes PPO's ratio against them, as on-policy training does.
    correction: str = "none"
    is_cap: float = 2.0  # tis: weights truncated here; decoupled: tokens above it left out (0: no cap)

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ValueError(f"loss.correction: unknown {self.correction!r}; expected one of {', '.join(CORRECTIONS)}")
        _finite("loss.is_cap", self.is_cap, low=0.0, open_low=self.correction == "tis")
        _finite("loss.value_clip", self.value_clip, low=0.0)
        _finite("loss.clip_eps_low", self.clip_eps_low, low=0.0)
        _finite("loss.clip_eps_high", self.clip_eps_high, low=0.0)
        _finite("loss.kl_coef", self.kl_coef, low=0.0)
        _finite("loss.entropy_coef", self.entropy_coef)


def _finite(name: str, value: float, *, low: float | None = None, high: float | None = None,
            below: float | None = None, open_low: bool = False) -> None:
    """ValueError naming the field unless `value` is finite and in range."""
    ok = math.isfinite(value) and (low is None or (value > low if open_low else value >= low)) \
        and (high is None or value <= high) and (below is None or value < below)
    if not ok:
        bounds = [f"{'>' if open_low else '>='} {low}" if low is not None else "",
                  f"<= {high}" if high is not None else "", f"< {below}" if below is not None else ""]
        wanted = " and ".join(b for b in bounds if b)
        raise ValueError(f"{name}: must be a finite number{' ' + wanted if wanted else ''}, got {value}")


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    model_path: str
    backend: str = "torch"
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    tags: tuple[str, ...] = ()
    eval_only: bool = False
    offload: bool = False
    colocate: bool = False
    micro_batch_size: int = 64
    bucket_bytes: int = 512 * 1024 * 1024
    master_weights: str = ""
    tensor_parallel: int = 1    # megatron: ranks that split each layer
    pipeline_parallel: int = 1  # megatron: ranks that split the layers
    role: str = "actor"         # "critic": a value model (the policy's architecture with a scalar head)
    compile: bool = True        # GPU: each decoder layer through torch.compile (fused norms, RoPE, SwiGLU)

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path: required")
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {', '.join(map(repr, ROLES))}, got {self.role!r}")
        if self.role == "critic":
            if self.backend != "torch":
                raise ValueError(f"role: a critic runs on the torch backend only for now, not {self.backend!r} "
                                 "(give the critic backend: torch; the actor may still use megatron)")
            if self.eval_only:
                raise ValueError("role: an eval-only job builds no critic")
            if self.tags:
                raise ValueError(f"tags: a critic keeps no extra copies, got {list(self.tags)}")
            if self.master_weights:
                raise ValueError("master_weights: not supported for a critic yet")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: unknown backend {self.backend!r} (available: {', '.join(map(repr, BACKENDS))})")
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
            if self.backend != "megatron" and getattr(self, name) != 1:
                raise ValueError(f"{name}: only the megatron backend splits the model; the torch backend is data parallel")
        devices.parse(self.device)
        torch_dtype(self.dtype)
        for tag in self.tags:
            if tag not in TAGS:
                raise ValueError(f"tags: unknown tag {tag!r} (expected one of {', '.join(TAGS)})")
        if self.loss.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"loss.kl_estimator: unknown {self.loss.kl_estimator!r}")
        if self.loss.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss.loss_agg: unknown {self.loss.loss_agg!r}")
        if self.scheduler.kind not in SCHEDULER_KINDS:
            raise ValueError(f"scheduler.kind: unknown {self.scheduler.kind!r}")
        if self.micro_batch_size < 1:
            raise ValueError("micro_batch_size: must be >= 1")
        if self.bucket_bytes < 1024:
            raise ValueError("bucket_bytes: must be >= 1024")
        if self.master_weights not in ("", "fp32"):
            raise ValueError(f"master_weights: expected '' or 'fp32', got {self.master_weights!r}")
