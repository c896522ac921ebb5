"""A one-off experiment (2026-12-02; its kernels and knobs exist at commit 0f8ca4c only,
so run it there): the decode step at small batches with the gated MLP's first
product and activation in one kernel (`_skinny_gated_kernel`, its weight tiles copied by the
tensor memory accelerator or by cp.async) against cuBLAS and `silu_mul`, and the attention and
down products on the small-batch kernel with TMA tiles; alternating in one process on one model.
The step time is (a call making 128 tokens - a call making 1) / 127, the median of 3, graphs
captured again for each variant.

    python bench/experiments/gated_mlp.py [variants] [batches]   # on a GPU
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

BASE = dict(gated_rows=0, gated_tma=False, gated_block_k=64, gated_stages=4, skinny_tma=False,
            skinny_max_bytes=8 << 20, blas="cublas")
VARIANTS = {
    "base": {},
    "base cublaslt": dict(blas="cublaslt"),
    "gated": dict(gated_rows=16),
    "gated tma": dict(gated_rows=16, gated_tma=True),
    "gated tma k128": dict(gated_rows=16, gated_tma=True, gated_block_k=128, gated_stages=3),
    "gated tma s6": dict(gated_rows=16, gated_tma=True, gated_stages=6),
    "gated tma+attn tma": dict(gated_rows=16, gated_tma=True, skinny_tma=True),
    "gated tma+down tma": dict(gated_rows=16, gated_tma=True, skinny_tma=True, skinny_max_bytes=1 << 40),
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
            greedy = Sampling(temperature=0.0, max_new_tokens=16, ignore_eos=True, seed=1)
            results = {}
            for _round in range(2):
                for name in names:
                    knobs = {**BASE, **VARIANTS[name]}
                    torch.backends.cuda.preferred_blas_library(knobs.pop("blas"))
                    for knob, value in knobs.items():
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
                    print(f"{shape} b{batch} {name:22s} step {sorted(steps)[1] * 1e6:7.1f} us  greedy tail {tokens}",
                          flush=True)
            print("# summary", shape, batch, {k: [round(v, 1) for v in vs] for k, vs in results.items()}, flush=True)
        core = model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
