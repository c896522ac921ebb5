"""The seam between the rollout service and a generation engine.

The servicer and the weight receiver see an engine only through `GenerationEngine`; which one
runs is the `engine` setting, looked up in `ENGINES`. The built-in engine (`engine: torch`,
`services.rollout.engine.RolloutEngine`) implements it over `services.rollout.builtin`; another
backend (SGLang over its HTTP API, say) is one more module with the same methods and one more
entry here, with no edit to the servicer.

Two optional parts, which the servicer looks for by attribute:

- a *serving* engine (`streams = True`) also has `submit(prompts, sampling, cancelled=,
  on_result=, priority=, on_finish=)`: the request joins one running batch shared with every
  other caller, `on_result(index, generation)` sees each completion as it finishes
  (`GenerateStream`) and `on_finish(request)` its end, with `request.error` saying what ended it
  (None: every row came back); `generate` then takes `priority` ("train" | "eval") too;
- `update_policies` lists what `apply` (and `update_from_*`) take as `policy`: "drain" (wait
  for the rows running), "pause" (swap between steps, the same rows continue under the new
  weights) or "abort" (rows running end with finish_reason "abort"). An engine without it
  drains, and the servicer refuses any other policy with INVALID_ARGUMENT.
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol

import torch

from services.models.tokenizer import Tokenizer
from services.rollout.types import Generation, Sampling
from services.weights.buckets import Manifest


class GenerationEngine(Protocol):
    device: torch.device
    tokenizer: Tokenizer
    weight_version: int
    serving: bool
    last_error: str
    released: set[str]
    checkpoint_step: int
    holds_buffers: bool  # the last `apply` kept the staged buffers as the model's weights
    keeps_staging: bool  # receive buffers may stay allocated between updates (False: freed after each)
    last_apply_seconds: float

    @property
    def num_parameters(self) -> int: ...

    @property
    def max_positions(self) -> int:
        """Prompt plus new tokens a row may hold."""

    def generate(self, prompts_ids: list[list[int]], sampling: Sampling,
                 cancelled: Callable[[], bool] | None = None) -> tuple[list[Generation], int]:
        """Completions (prompt-major) and the oldest weight version that made any of their tokens
        (each `Generation.versions` says which tokens came from which, where the engine knows)."""

    def read_manifest(self, msg) -> Manifest:
        """A received manifest, validated against this engine's model (ManifestMismatch if not)."""

    def apply(self, manifest: Manifest, buffers: list[torch.Tensor], *, read_back: bool = False,
              adopt: bool = False, owned: bool = False) -> int:
        """Load verified buckets and switch to the manifest's version atomically, between two
        decode steps (never within one); bytes loaded. Engines with `update_policies` also take
        `policy=`."""

    def leave_pool(self, reason: str) -> None: ...

    def release_memory(self, tags: list[str]) -> None: ...

    def resume_memory(self, tags: list[str]) -> None: ...

    def fingerprints(self, algo: str, bucket_bytes: int) -> list[str]: ...

    def capabilities(self):
        """What the coordinator may send this engine weights over (weights_pb2.Capabilities)."""

    def close(self) -> None: ...


class ReceivesItself(Protocol):
    """An engine that takes some planes' bytes itself (SGLang does): for each source in
    `receives` ("broadcast": it joins the group; "cuda_ipc": it opens the trainer's handles) the
    servicer hands it the update instead of receiving the buckets."""

    receives: frozenset[str]

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> None: ...

    def destroy_group(self, group_name: str) -> bool: ...

    def update_from_broadcast(self, manifest: Manifest, group_name: str, timeout_s: float,
                              read_back: bool = False) -> int: ...

    def update_from_cuda_ipc(self, manifest: Manifest, handles, timeout_s: float, read_back: bool = False) -> int: ...


def build_engine(settings) -> GenerationEngine:
    """The engine `settings.engine` names (settings: `services.rollout.engine.RolloutSettings`)."""
    if settings.engine not in ENGINES:
        raise ValueError(f"engine: unknown engine {settings.engine!r} (available: {', '.join(sorted(ENGINES))})")
    module, name = ENGINES[settings.engine]
    return getattr(importlib.import_module(module), name)(settings)


ENGINES = {
    "torch": ("services.rollout.engine", "RolloutEngine"),  # the built-in engine
    "sglang": ("services.rollout.sglang.engine", "SglangEngine"),  # SGLang over its HTTP API
}
