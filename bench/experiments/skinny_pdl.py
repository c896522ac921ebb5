"""A one-off experiment (2026-12-02): the decode step at small batches with its products on cuBLAS
or on `_skinny_linear_kernel`, and with or without programmatic dependent launch (PDL), alternating
in one process on one model. The step time is (a call making 128 tokens - a call making 1) / 127,
the median of 3, graphs captured again for each variant.

    python bench/experiments/skinny_pdl.py   # on a GPU
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import VOCAB, _Ids, make_model, timed  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

KNOBS = ("skinny_rows", "pdl", "skinny_block_n", "skinny_block_k", "skinny_warps", "skinny_stages", "skinny_max_bytes")
VARIANTS = {  # name: (skinny rows, pdl, block_n, block_k, warps, stages, largest weight in bytes)
    "cublas": (0, False, 64, 128, 4, 3),
    "cublas+pdl": (0, True, 64, 128, 4, 3),
    "skinny": (16, False, 64, 128, 4, 3),
    "skinny+pdl": (16, True, 64, 128, 4, 3),
    "skinny+pdl k64": (16, True, 64, 64, 4, 4),
    "skinny+pdl n128": (16, True, 128, 128, 8, 3),
    "skinny+pdl <=20MB": (16, True, 64, 128, 4, 3, 20 << 20),
    "skinny+pdl <=8MB": (16, True, 64, 128, 4, 3, 8 << 20),
    "skinny+pdl <=10MB": (16, True, 64, 128, 4, 3, 10 << 20),
    "skinny+pdl <=8MB n32": (16, True, 32, 128, 4, 3, 8 << 20),
    # Later the same day a variant of the kernel loading its weight tile whole before the wait
    # ("resident <=8MB", "resident <=10MB", "resident all", "resident all silu apart", "resident
    # all k512" in bench/results/skinny_pdl-experiment-{5,6}-*.txt) was measured; it did not pay
    # and was taken out, so those variants run only at commit 2f73e50.
}


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 1]
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
                    values = dict(zip(KNOBS, VARIANTS[name]))
                    values.setdefault("skinny_max_bytes", 1 << 40)
                    for knob, value in values.items():
                        setattr(core.ops, knob, value)
                    if core.runner is not None:
                        core.runner.drop_graphs()
                    core.generate(prompts, full)  # compile, capture
                    steps = []
                    for _ in range(3):
                        steps.append((timed(lambda: core.generate(prompts, full), "cuda")
                                      - timed(lambda: core.generate(prompts, one), "cuda")) / 127)
                    results.setdefault(name, []).append(sorted(steps)[1] * 1e6)
                    tokens = [r.output_ids[:4] for r in core.generate(prompts[:2], full)]
                    print(f"{shape} b{batch} {name:26s} step {sorted(steps)[1] * 1e6:7.1f} us  first tokens {tokens}",
                          flush=True)
            print("# summary", shape, batch, {k: [round(v, 1) for v in vs] for k, vs in results.items()}, flush=True)
        core = model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
