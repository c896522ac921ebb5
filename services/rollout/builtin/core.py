"""The built-in engine's generation core: a KV cache, a model runner and a scheduler for one model.

The rollout engine `submit`s requests and runs `round`s on its serving thread, under its lock;
`generate` serves one call on the caller's thread (tests and benchmarks). The KV pool is made
at the first call: on a GPU, `kv_cache_fraction` of the memory free at that moment (never more
than `max_batch_size` rows of `max_position_embeddings` tokens need); on a CPU, just what a full
batch of this call's longest row needs, grown when a later call needs more. `release` frees the
pool and the captured graphs (a colocated engine hands its memory to the trainer), and the next
call makes them again.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Callable

import torch

from services.models.decoder import DecoderLM
from services.models.tokenizer import Tokenizer
from services.rollout.builtin.forward import PagedDecoder, fuse_projections
from services.rollout.builtin.kv_cache import KVShape, PagedKVCache, blocks_in_budget
from services.rollout.builtin.ops import TorchOps
from services.rollout.builtin.runner import ModelRunner
from services.rollout.builtin.scheduler import Request, Scheduler
from services.rollout.types import Generation, Sampling, validate_prompts

log = logging.getLogger("rlfleet.rollout")

MAX_PREFILL_TOKENS = 16384  # per prefill forward: bounds its activations
MAX_BATCH_SIZE = 4096


@dataclass(frozen=True, kw_only=True)
class CoreSettings:
    max_batch_size: int = 256
    kv_cache_fraction: float = 0.5
    cuda_graphs: bool = True
    prefix_cache: bool = False
    check_every: int = 0  # decode steps between host checks; 0: 1 on CPU, 8 on a GPU

    def __post_init__(self) -> None:
        if not 1 <= self.max_batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"max_batch_size: must be in [1, {MAX_BATCH_SIZE}], got {self.max_batch_size}")
        if not 0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction: must be in (0, 0.95], got {self.kv_cache_fraction}")


def gpu_ops(device: torch.device):
    """Triton kernels on a CUDA device where Triton imports; the torch ops otherwise."""
    if device.type == "cuda":
        try:
            from services.rollout.builtin.kernels import TritonOps
        except ImportError:  # no Triton: torch ops, still captured in graphs
            log.warning("triton is not installed: the engine runs its torch ops on %s", device)
        else:
            return TritonOps()
    return TorchOps()


class GenerationCore:
    def __init__(self, model: DecoderLM, tokenizer: Tokenizer, device: torch.device, settings: CoreSettings):
        self.model, self.tokenizer, self.device, self.settings = model, tokenizer, device, settings
        self.config = model.config
        dtype = model.model.embed_tokens.weight.dtype
        self.shape = KVShape(num_layers=self.config.num_hidden_layers, num_kv_heads=self.config.num_key_value_heads,
                             head_dim=self.config.head_dim, dtype=dtype)
        self.on_gpu = device.type == "cuda"
        # GPU: q/k/v and gate/up side by side, at addresses that never move (updates copy in).
        self.fused = fuse_projections(model) if self.on_gpu else None
        self.ops = gpu_ops(device)
        self.cache: PagedKVCache | None = None
        self.runner: ModelRunner | None = None
        self.scheduler: Scheduler | None = None
        self.check_every = settings.check_every or (8 if self.on_gpu else 1)
        self.last_seconds = 0.0
        self.version = 0

    @property
    def stable_weights(self) -> bool:
        """Whether weight updates must copy into the current tensors (graphs hold their addresses)."""
        return self.on_gpu

    def request(self, prompts_ids: list[list[int]], sampling: Sampling, *, cancelled: Callable[[], bool] | None = None,
                on_result: Callable[[int, Generation], None] | None = None, priority: str = "train",
                on_finish: Callable[[Request], None] | None = None) -> Request:
        """A validated request (ValueError naming the field if the model cannot take it), to `submit`."""
        packed = validate_prompts(prompts_ids, sampling, self.config.vocab_size, self.config.max_position_embeddings)
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        seed = sampling.seed if sampling.seed is not None else random.SystemRandom().getrandbits(63)
        return Request(packed.as_lists(prompts_ids), packed, sampling, frozenset(stop_ids), seed, priority=priority,
                       cancelled=cancelled, on_result=on_result, on_finish=on_finish)

    def prepare(self, request: Request) -> None:
        """Make the pool, runner and scheduler for `request` if there are none."""
        if self.scheduler is None and request.prompts:
            self._ensure(request.longest, len(request.results))

    def submit(self, request: Request) -> Request:
        """Queue `request`: its rows join the running batch at a coming `round`."""
        self.prepare(request)
        if self.scheduler is None:
            request.finish()  # no prompts, no completions (as the eager loop answers)
            return request
        return self.scheduler.submit(request)

    @property
    def busy(self) -> bool:
        return self.scheduler is not None and self.scheduler.busy

    def round(self) -> None:
        """One round of the running batch (`Scheduler.round`). On a CPU, the pool grows first if
        it is too small for the rows running and waiting (between rounds block ids stay valid, and
        each step reads the pool afresh: no captured addresses)."""
        scheduler = self.scheduler
        if not self.on_gpu and scheduler.rows_waiting:
            longest = max(r.longest for r in scheduler.live())
            self._ensure(longest, scheduler.rows_running + scheduler.rows_waiting)
        started = time.perf_counter()
        with torch.inference_mode():
            self.scheduler.round()
        self.last_seconds = time.perf_counter() - started

    def generate(self, prompts_ids: list[list[int]], sampling: Sampling,
                 cancelled: Callable[[], bool] | None = None) -> list[Generation]:
        """One call served on this thread, round by round, until it is done."""
        request = self.submit(self.request(prompts_ids, sampling, cancelled=cancelled))
        while not request.finished.is_set():
            self.round()
        return request.wait()

    def set_version(self, version: int) -> None:
        """The weights changed (between rounds): the next tokens are `version`'s."""
        self.version = version
        if self.scheduler is not None:
            self.scheduler.set_version(version)

    def _ensure(self, longest: int, num_rows: int) -> None:
        """Make the pool, runner and scheduler if there are none (or, on a CPU, too small ones)."""
        max_positions = self.config.max_position_embeddings
        blocks_per_row = self.shape.blocks_for(max_positions)
        capacity = self.settings.max_batch_size
        if self.cache is not None:
            if not self.on_gpu:  # (no row runs) grown in place: held blocks, cached prefixes and all
                self.cache.grow(self._cpu_blocks(longest, num_rows))
            return
        if self.on_gpu:
            free, _ = torch.cuda.mem_get_info(self.device)
            blocks = min(blocks_in_budget(self.shape, int(free * self.settings.kv_cache_fraction)),
                         capacity * blocks_per_row + 1)
        else:
            blocks = self._cpu_blocks(longest, num_rows)
        self.cache = PagedKVCache(self.shape, blocks, self.device)
        decoder = PagedDecoder(self.model, self.cache, self.ops, self.fused)
        self.runner = ModelRunner(decoder, self.cache, capacity=capacity, max_new_tokens=max_positions,
                                  max_blocks_per_row=blocks_per_row, use_graphs=self.settings.cuda_graphs)
        if self.scheduler is None:
            self.scheduler = Scheduler(self.runner, self.cache, self.tokenizer, check_every=self.check_every,
                                       max_prefill_tokens=MAX_PREFILL_TOKENS, version=self.version,
                                       prefix_cache=self.settings.prefix_cache)
        else:  # (no row runs) the waiting requests stay queued
            self.scheduler.attach(self.runner, self.cache)
        log.info("kv cache: %d blocks of %d tokens (%.1f MB) on %s, %s ops, CUDA graphs %s", blocks,
                 self.shape.block_size, self.cache.nbytes / 1e6, self.device, self.ops.name,
                 "on" if self.runner.use_graphs else "off")

    def _cpu_blocks(self, longest: int, num_rows: int) -> int:
        """A full batch of rows as long as this call's longest, within a quarter of free RAM."""
        rows = min(num_rows, self.settings.max_batch_size)
        wanted = rows * self.shape.blocks_for(longest) + 1
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return wanted
        return max(self.shape.blocks_for(longest) + 1, min(wanted, blocks_in_budget(self.shape, free // 4)))

    def release(self) -> None:
        """Free the KV pool and the graphs; the next call makes them again (no request may be
        live: the engine ends them first)."""
        if self.runner is not None:
            self.runner.drop_graphs()
        self.cache = self.runner = self.scheduler = None
        if self.on_gpu:
            torch.cuda.empty_cache()

    def drop_graphs(self) -> None:
        """The weights moved (released and reallocated): capture again at the next call."""
        if self.runner is not None:
            self.runner.drop_graphs()
