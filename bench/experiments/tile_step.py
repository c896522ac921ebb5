"""A screening experiment (2026-12-03): the decode step with the attention's q/k/v and o
products of more than 16 rows on `_tile_linear_kernel` (`TritonOps.tile_*`), as the engine
takes them, against cuBLAS; and on top, the gated MLP's products at 129-256 rows on the CUDA C
kernels of `hopper_gemm.py` (TMA multicast, distributed shared memory); alternating in one
process on one model (see `alternate.py`).

The first runs (`bench/results/tile_step-experiment-*`) compared tile shapes, the kernel with and
without asking L2 for its weight before its wait, and the MLP's down product on it with k split
in shares; those knobs exist at commit 38f4f74 only.

    python bench/experiments/tile_step.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402
from bench.experiments.hopper_gemm import ClusterGemm  # noqa: E402
from services import devices  # noqa: E402
from services.rollout.builtin.kernels import TritonOps  # noqa: E402

VARIANTS = {
    "cublas": dict(tile_max_bytes=0, tile_wide_max_bytes=0),
    "tile": dict(tile_max_bytes=TritonOps.tile_max_bytes, tile_wide_max_bytes=TritonOps.tile_wide_max_bytes),
    # the tile kernel as the engine takes it, and the MLP's products on `hopper_gemm.py`'s kernels
    "tile+gate_up": dict(hopper=True, down=False),
    "tile+gate_up+down": dict(hopper=True, down=True),
    "tile+gate_up+down s6": dict(hopper=True, down=True, stages=6),
}


class _Hopper:
    """TritonOps.linear with the gated MLP's products of 129-256 bf16 rows on `hopper_gemm`'s
    kernels: gate/up (n >= 4096, k < 2048) as "wide" (x multicast over clusters of 2), down
    (k >= 2048) as "down" (k split over clusters of 8) if `down`."""

    def __init__(self, ops, down: bool, stages: int):
        self.ops, self.down, self.stages, self.base, self.gemms = ops, down, stages, type(ops).linear, {}

    def __call__(self, x, weight, bias=None):
        rows, k = x.shape
        n = weight.shape[0]
        fits = (129 <= rows <= 256 and bias is None and x.dtype == weight.dtype == torch.bfloat16
                and x.is_contiguous() and weight.is_contiguous() and k % 64 == 0)
        key = None
        if fits and k >= 2048 and self.down:
            key = ("down", 128, self.stages, 8)
        elif fits and k < 2048 and n >= 4096:
            bn = -(-n // (8 * devices.sm_count(x.device))) * 8  # one wave
            key = ("wide", bn, min(self.stages, (220 << 10) // ((256 + bn) * 128)), 2)
        if key is None:
            return self.base(self.ops, x, weight, bias)
        if key not in self.gemms:
            self.gemms[key] = ClusterGemm(key[1], key[2], key[3], key[0])
        return self.gemms[key](x, weight)


def apply(core, name: str) -> None:
    knobs = dict(VARIANTS[name])
    hopper, down, stages = knobs.pop("hopper", False), knobs.pop("down", False), knobs.pop("stages", 4)
    for knob, value in knobs.items():
        setattr(core.ops, knob, value)
    core.ops.__dict__.pop("linear", None)
    if hopper:
        core.ops.linear = _Hopper(core.ops, down, stages)


def main() -> None:
    alternate(*cli(VARIANTS, [256, 128, 64, 32]), apply, describe=greedy_tail)


if __name__ == "__main__":
    main()
