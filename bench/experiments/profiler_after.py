"""A one-off experiment (2026-12-02): does a generate call run slower once a torch profiler
session has run in the process? `bench/rollout.py --parts sweep` profiled each batch (its
`split_ms`) before timing the next; its batch-16 and -256 figures read 1-2% below those of
runs without profiling, and its batch-256 prefill 5 ms above, on other machines. Here, in one
process: time the 0.5B calls of batch 16 and 256 (the median of 3, as the sweep does), run the
sweep's profile of a step, time them again; twice.

    python bench/experiments/profiler_after.py   # on a GPU
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import FULL, ONE  # noqa: E402
from bench.rollout import VOCAB, _Ids, make_model, step_split, timed  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402


def median(fn) -> float:
    return sorted(timed(fn, "cuda") for _ in range(3))[1] * 1e3


def main() -> None:
    model = make_model("0.5b", torch.bfloat16, "cuda")
    core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=256))
    rng = random.Random(0)
    batches = {b: [[rng.randrange(VOCAB) for _ in range(64)] for _ in range(b)] for b in (16, 256)}
    for prompts in batches.values():
        core.generate(prompts, FULL)  # compile, capture
    for round_ in range(2):
        for label in ("before", "after"):
            for batch, prompts in batches.items():
                call, prefill = median(lambda: core.generate(prompts, FULL)), median(lambda: core.generate(prompts, ONE))
                print(f"round {round_} {label:6s} profiling  b{batch:<3d} call {call:7.2f} ms  prefill call {prefill:6.2f} ms  "
                      f"step {(call - prefill) / 127 * 1e3:7.1f} us", flush=True)
            if label == "before":
                step_split(core, batches[16])


if __name__ == "__main__":
    main()
