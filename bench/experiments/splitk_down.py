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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402

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


def apply(core, name: str) -> None:
    for knob, value in {**BASE, **VARIANTS[name]}.items():
        setattr(core.ops, knob, value)


def main() -> None:
    alternate(*cli(VARIANTS, [256, 64]), apply, describe=greedy_tail)

if __name__ == "__main__":
    main()
