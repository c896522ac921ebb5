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

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402

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


def apply(core, name: str) -> None:
    knobs = {**BASE, **VARIANTS[name]}
    torch.backends.cuda.preferred_blas_library(knobs.pop("blas"))
    for knob, value in knobs.items():
        setattr(core.ops, knob, value)


def main() -> None:
    alternate(*cli(VARIANTS, [16, 1]), apply, describe=greedy_tail)

if __name__ == "__main__":
    main()
