"""A one-off experiment (2026-12-02): the decode step with the paged attention split for more
(or fewer) programs per SM, or launched with other warps, pipeline stages or tiles, at batches 16-256; alternating
in one process on one model (step time = (a call making 128 tokens - a call making 1) / 127, the
median of 3, graphs captured again for each variant). Then, at the base settings, where a call's
host time goes: the scheduler's phase times for a 1-token and a 128-token call, and the host-side
operations of a 1-token call as the profiler counts them.

    python bench/experiments/attention_splits.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402
from services.rollout.builtin.core import GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

BASE = dict(split_programs_per_sm=2, attention_warps=4, attention_stages=2, unsplit_tile=64)
VARIANTS = {
    "base": {},
    "split4": dict(split_programs_per_sm=4),
    "split8": dict(split_programs_per_sm=8),
    "split16": dict(split_programs_per_sm=16),
    "stages3": dict(attention_stages=3),
    "warps2": dict(attention_warps=2),
    "split8 warps2": dict(split_programs_per_sm=8, attention_warps=2),
    # later the same day, with RoPE inside the attention kernel (5a584f6)
    "split1": dict(split_programs_per_sm=1),
    "stages1": dict(attention_stages=1),
    "tile32": dict(unsplit_tile=32),
    # the next day, at 1dbc3b3 only (the knobs were taken out: within 1-2%, mostly slower): the
    # tokens after the first tile asked of L2 before the wait ("pf128", "pf256"), a register cap
    # of 128 for the unsplit kernel ("reg128"), and their mixes with 32-token tiles
    # (bench/results/attention_splits-experiment-3-*). Then 128-token tiles for unsplit rows of
    # heads up to 64 wide (wider heads stay at 64), so a row of up to 128 tokens is read whole
    # before the wait:
    "tile128": dict(unsplit_tile=128),
    "tile128 stages1": dict(unsplit_tile=128, attention_stages=1),
    # Session 18 (2026-12-02, after the sampling change): one warp a program, so that the
    # softmax's row maxima and sums stay inside a warp (with 4 warps each is a shared-memory
    # round trip and two barriers, a tile), alone and with more programs per SM. All slower at
    # 4395a68 (attention_splits-experiment-5-*): 0.5B batch 256 1339 -> 1359-1380 us, batch 16
    # 798 -> 821-856; 1.5B batch 256 2513 -> 2587-2854, batch 16 1488 -> 1568-1866.
    "warps1": dict(attention_warps=1),
    "warps1 split4": dict(attention_warps=1, split_programs_per_sm=4),
    "warps1 split8": dict(attention_warps=1, split_programs_per_sm=8),
    "warps2 split4": dict(attention_warps=2, split_programs_per_sm=4),
    # Session 19 (2026-12-02, working tree only, the kernel kept in bench/results/
    # attention_splits-experiment-6-*): a row's two KV heads in one program, their keys side by
    # side as one tile of 2 x D columns and each query head's values in its own KV head's columns
    # (14 of 16 query rows real instead of 7, one softmax a tile for both); knob
    # `attention_kv_per_program=2`, alone ("pairs"), with 4 programs per SM, or 8 warps. Slower at
    # every batch: 0.5B batch 256 1328 -> 1366 us (1434, 1495), batch 16 794 -> 848; 1.5B batch
    # 256 2500 -> 2645, batch 16 1480 -> 1658 (1583 with 8 warps).
    # (The recorded run, attention_splits-experiment-4-*, on an H100, also had "late table": its
    # "base" there read the first tile's block-table entries alongside the row length instead of
    # after it, a change tried in the working tree and not kept: 0.5B batch 256 -1%, 1.5B +2%.)
}


def host_breakdown(core: GenerationCore, prompts: list[list[int]]) -> None:
    from torch.profiler import ProfilerActivity, profile

    for new in (1, 128):
        sampling = Sampling(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=1)
        core.generate(prompts, sampling)
        torch.cuda.synchronize()
        started = time.perf_counter()
        core.generate(prompts, sampling)
        wall = time.perf_counter() - started
        print(f"# host b{len(prompts)} {new} tokens: call {wall * 1e3:.2f} ms, {core.scheduler.last_stats}", flush=True)
    one = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        core.generate(prompts, one)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)


def apply(core: GenerationCore, name: str) -> None:
    for knob, value in {**BASE, **VARIANTS[name]}.items():
        setattr(core.runner if knob == "split_programs_per_sm" else core.ops, knob, value)


def after(shape: str, batch: int, core: GenerationCore, prompts: list[list[int]]) -> None:
    if shape == "0.5b" and batch in (256, 16) and not os.environ.get("NO_HOST_BREAKDOWN"):
        apply(core, "base")
        core.runner.drop_graphs()
        host_breakdown(core, prompts)


def main() -> None:
    alternate(*cli(VARIANTS, [256, 64, 16]), apply, after=after, describe=greedy_tail)

if __name__ == "__main__":
    main()
