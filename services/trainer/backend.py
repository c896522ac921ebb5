"""The trainer backend: what the trainer servicer and the weight pusher depend on.

A backend owns one rank's share of the policy (a whole model for torch, a tensor / pipeline shard
for megatron), its optimizer and schedule, and the memory lifecycle (sleep, wake, tags, host
store). The servicer only translates protobuf to these calls; `build_backend` picks the
implementation by name, importing it only when it is asked for (megatron-core is optional).

Every rank of a trainer group is called with the same batch; the backend splits it across its
data-parallel ranks. The rank that is the weight source (`weights_for_sync` returns weights)
serves manifests, `GetWeights` and pushes; on the others it returns None.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from services.trainer.batch import Sample
from services.trainer.host_store import HostCopy
from services.trainer.settings import TrainerSettings
from services.weights.buckets import BucketSpec


class TrainerStateError(RuntimeError):
    """An operation that the trainer's current state does not allow (e.g. training in eval-only)."""


@dataclass(frozen=True)
class StepResult:
    metrics: dict[str, float]
    weights_version: int
    step: int


@dataclass(frozen=True)
class LifecycleState:
    asleep: bool
    active_tag: str
    weights_version: int
    gpu_bytes_in_use: int
    host_backup_bytes: int


@dataclass(frozen=True)
class SyncWeights:
    """Where a weight sync reads, in Hugging Face names and the sync bucket layout."""

    source: str                                   # "host": the host actor copy; "gpu": live weights
    weights: HostCopy | dict[str, torch.Tensor]
    layout: list[BucketSpec]
    views: list[torch.Tensor] | None              # live bucket views (source "gpu" only)


class TrainerBackend(Protocol):
    settings: TrainerSettings
    device: torch.device
    step: int
    weights_version: int
    checkpoint_step: int

    @property
    def num_parameters(self) -> int: ...
    @property
    def has_optimizer(self) -> bool: ...
    @property
    def has_scheduler(self) -> bool: ...
    @property
    def rank(self) -> int: ...

    def lifecycle(self) -> LifecycleState: ...
    def sleep(self) -> LifecycleState: ...
    def wake(self) -> LifecycleState: ...
    def compute_logprobs(self, tag: str, samples: list[Sample]) -> tuple[list[list[float]], float]: ...
    def compute_values(self, samples: list[Sample]) -> list[list[float]]: ...  # critics; actors refuse
    def train_step(self, samples: list[Sample], *, sft: bool = False, value: bool = False,
                   lr: float | None = None) -> StepResult: ...  # value: the critic's loss, refused by actors
    def weights_for_sync(self) -> SyncWeights | None: ...
    def save_checkpoint(self, path: str, *, include_optimizer: bool) -> None: ...
    def load_checkpoint(self, path: str, *, load_optimizer: bool) -> None: ...
    def close(self) -> None: ...


BACKENDS = {
    "torch": ("services.trainer.torch_backend", "TorchTrainer"),
    "megatron": ("services.trainer.megatron_backend", "MegatronTrainer"),
}


# A critic (PPO's value model) is its own implementation of the same interface.
CRITICS = {
    "torch": ("services.trainer.critic", "TorchCritic"),
}


def build_backend(settings: TrainerSettings) -> TrainerBackend:
    """The backend `settings.backend` names, built for this rank (the rank group is already formed)."""
    registry = CRITICS if settings.role == "critic" else BACKENDS
    module, name = registry[settings.backend]  # settings validated the name (and that a critic runs on torch)
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ValueError(f"backend: {settings.backend!r} is not installed here ({e}); "
                         f"install rlfleet[{settings.backend}]") from e
    return cls(settings)
