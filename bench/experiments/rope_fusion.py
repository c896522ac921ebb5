"""An experiment (2026-12-02): the decode step with RoPE and the key/value store in their own
kernel or inside the attention kernel (`TritonOps.fuse_rope`), and the small batch's down product
on cuBLAS (after a SiLU kernel) or on the small-batch kernel with the SiLU read in
(`skinny_max_bytes` past its 8.7 MB weight), and 4 or 8 warps for attention, variants
alternating in one process (`alternate.py`).

    python bench/experiments/rope_fusion.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402

# The prefetch variants ("fused+prefetch", "fused+prefetch 16MB", "fused+prefetch+down skinny")
# and the norm tail ("norm tail 4k", "norm tail 8k") lost everywhere and their code was taken
# out: they run at commit d49913e only (bench/results/rope_fusion-experiment-{1,3}-*.txt).
VARIANTS = {  # name: (fuse_rope, skinny_max_bytes, attention_warps)
    "rope apart": (False, 8 << 20, 4),
    "rope fused": (True, 8 << 20, 4),
    "fused+down skinny": (True, 10 << 20, 4),
    "fused 8 warps": (True, 8 << 20, 8),
}


def apply(core, name: str) -> None:
    core.ops.fuse_rope, core.ops.skinny_max_bytes, core.ops.attention_warps = VARIANTS[name]


def main() -> None:
    alternate(*cli(VARIANTS, [16, 256, 1, 64]), apply, describe=greedy_tail)


if __name__ == "__main__":
    main()
