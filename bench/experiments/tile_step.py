"""A screening experiment (2026-12-03): the decode step with the attention's q/k/v and o
products of more than 16 rows on `_tile_linear_kernel` (`TritonOps.tile_*`) in a few tile
shapes, with and without asking L2 for the weights before the kernel's wait, and the MLP's down
product on it too (k split in 4 shares), against cuBLAS; alternating in one process on one model (see `alternate.py`).

    python bench/experiments/tile_step.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402

VARIANTS = {  # tile_config: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, k shares; "pf": tile_prefetch
    "cublas": dict(tile_max_bytes=0),
    "64x32": {},
    "64x32 pf": dict(tile_prefetch=True),
    "64x64 pf": dict(tile_prefetch=True, tile_config=(64, 64, 128, 4, 3, 1)),
    "64x32 +down": dict(tile_long_max_bytes=64 << 20),
    "64x32 pf +down": dict(tile_prefetch=True, tile_long_max_bytes=64 << 20),
    "64x32 pf +down 128x64": dict(tile_prefetch=True, tile_long_max_bytes=64 << 20,
                                  tile_long_config=(128, 64, 64, 4, 4, 4)),
}
BASE = dict(tile_max_bytes=8 << 20, tile_config=(64, 32, 128, 4, 3, 1), tile_prefetch=False, tile_long_max_bytes=0,
            tile_long_config=(64, 64, 64, 4, 4, 4))


def apply(core, name: str) -> None:
    for knob, value in {**BASE, **VARIANTS[name]}.items():
        setattr(core.ops, knob, value)


def main() -> None:
    alternate(*cli(VARIANTS, [256, 64]), apply, describe=greedy_tail)


if __name__ == "__main__":
    main()
