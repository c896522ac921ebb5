"""A screening experiment (2026-12-03): the decode step with the attention's q/k/v and o
products of more than 16 rows on `_tile_linear_kernel` (`TritonOps.tile_*`), as the engine
takes them, against cuBLAS; alternating in one process on one model (see `alternate.py`).

The first runs (`bench/results/tile_step-experiment-*`) compared tile shapes, the kernel with and
without asking L2 for its weight before its wait, and the MLP's down product on it with k split
in shares; those knobs exist at commit 38f4f74 only.

    python bench/experiments/tile_step.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402
from services.rollout.builtin.kernels import TritonOps  # noqa: E402

VARIANTS = {
    "cublas": dict(tile_max_bytes=0, tile_wide_max_bytes=0),
    "tile": dict(tile_max_bytes=TritonOps.tile_max_bytes, tile_wide_max_bytes=TritonOps.tile_wide_max_bytes),
}


def apply(core, name: str) -> None:
    for knob, value in VARIANTS[name].items():
        setattr(core.ops, knob, value)


def main() -> None:
    alternate(*cli(VARIANTS, [256, 128, 64, 32]), apply, describe=greedy_tail)


if __name__ == "__main__":
    main()
