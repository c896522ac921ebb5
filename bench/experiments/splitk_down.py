"""A one-off experiment (2026-12-02; its kernel and knobs exist at commit e3422d3 only,
so run it there): the decode step at batches of 32-256 with the gated MLP's
down product (and its SiLU) on `_splitk_linear_kernel` (TMA tiles, k split so the GPU runs one
wave, partials added in split order in the same launch) against cuBLAS (split-k and a second
reduce kernel) after `silu_mul`; alternating in one process on one model. The step time is
(a call making 128 tokens - a call making 1) / 127, the median of 3, graphs captured again for
each variant.

    python bench/experiments/splitk_down.py [variants] [batches]   # on a GPU
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

BASE = dict(splitk_rows=(17, 512), splitk_block_n=128, splitk_block_k=64, splitk_stages=3, splitk_fuse_silu=True,
            splitk_all=False)
VARIANTS = {
    "cublas": dict(splitk_rows=(0, -1)),
    "down+silu": {},
    "down+silu s4": dict(splitk_stages=4),
    "down+silu k128 s2": dict(splitk_block_k=128, splitk_stages=2),
    "down+silu n64": dict(splitk_block_n=64),
    "down apart": dict(splitk_fuse_silu=False, splitk_all=True, splitk_rows=(17, 512)),
    "all": dict(splitk_all=True),
}


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [256, 64]
    for shape in ("0.5b", "1.5b"):
        model = make_model(shape, torch.bfloat16, "cuda")
        core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=256))
        rng = random.Random(0)
        for batch in batches:
            prompts = [[rng.randrange(VOCAB) for _ in range(64)] for _ in range(batch)]
            full = Sampling(temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=1)
            one = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=1)
            greedy = Sampling(temperature=0.0, max_new_tokens=16, ignore_eos=True, seed=1)
            results = {}
            for _round in range(2):
                for name in names:
                    for knob, value in {**BASE, **VARIANTS[name]}.items():
                        setattr(core.ops, knob, value)
                    if core.runner is not None:
                        core.runner.drop_graphs()
                    core.generate(prompts, full)  # compile, capture
                    steps = []
                    for _ in range(3):
                        steps.append((timed(lambda: core.generate(prompts, full), "cuda")
                                      - timed(lambda: core.generate(prompts, one), "cuda")) / 127)
                    results.setdefault(name, []).append(sorted(steps)[1] * 1e6)
                    tokens = [r.output_ids[-4:] for r in core.generate(prompts[:2], greedy)]
                    print(f"{shape} b{batch} {name:20s} step {sorted(steps)[1] * 1e6:7.1f} us  greedy tail {tokens}",
                          flush=True)
            print("# summary", shape, batch, {k: [round(v, 1) for v in vs] for k, vs in results.items()}, flush=True)
        core = model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
