"""A one-off experiment (2026-12-02): the decode step with the paged attention split for more
programs per SM, or launched with other warps and pipeline stages, at batches 16-256; alternating
in one process on one model (step time = (a call making 128 tokens - a call making 1) / 127, the
median of 3, graphs captured again for each variant). Then, at the base settings, where a call's
host time goes: the scheduler's phase times for a 1-token and a 128-token call, and the host-side
operations of a 1-token call as the profiler counts them.

    python bench/experiments/attention_splits.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import VOCAB, _Ids, make_model, timed  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
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


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [256, 64, 16]
    for shape in ("0.5b", "1.5b"):
        model = make_model(shape, torch.bfloat16, "cuda")
        core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=256))
        rng = random.Random(0)
        for batch in batches:
            prompts = [[rng.randrange(VOCAB) for _ in range(64)] for _ in range(batch)]
            full = Sampling(temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=1)
            one = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=1)
            results = {}
            for _round in range(2):
                for name in names:
                    core.generate(prompts[:1], one)  # the runner exists
                    for knob, value in {**BASE, **VARIANTS[name]}.items():
                        setattr(core.runner if knob == "split_programs_per_sm" else core.ops, knob, value)
                    core.runner.drop_graphs()
                    core.generate(prompts, full)  # compile, capture
                    steps = []
                    for _ in range(3):
                        steps.append((timed(lambda: core.generate(prompts, full), "cuda")
                                      - timed(lambda: core.generate(prompts, one), "cuda")) / 127)
                    results.setdefault(name, []).append(sorted(steps)[1] * 1e6)
                    print(f"{shape} b{batch} {name:16s} step {sorted(steps)[1] * 1e6:7.1f} us", flush=True)
            print("# summary", shape, batch, {k: [round(v, 1) for v in vs] for k, vs in results.items()}, flush=True)
            if shape == "0.5b" and batch in (256, 16):
                for knob, value in BASE.items():
                    setattr(core.runner if knob == "split_programs_per_sm" else core.ops, knob, value)
                core.runner.drop_graphs()
                host_breakdown(core, prompts)
        core = model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
