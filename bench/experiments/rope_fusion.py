"""An experiment (2026-12-02): the decode step with RoPE and the key/value store in their own
kernel or inside the attention kernel (`TritonOps.fuse_rope`), and the small batch's down product
on cuBLAS (after a SiLU kernel) or on the small-batch kernel with the SiLU read in
(`skinny_max_bytes` past its 8.7 MB weight), the attention kernel asking L2 for the layer's
MLP weights or not (`prefetch_rows`, `prefetch_bytes`), and the attention output product's
add_rmsnorm in its own kernel or in the product's last program (`norm_tail`, `norm_tile`),
variants alternating in one process (`alternate.py`). Variants without the norm settings run
with the norm in its own kernel.

    python bench/experiments/rope_fusion.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402

ALWAYS = 1 << 20
VARIANTS = {  # name: (fuse_rope, skinny_max_bytes, prefetch_rows, prefetch_bytes, attention_warps[, norm_tail, norm_tile])
    "rope apart": (False, 8 << 20, 0, 0, 4),
    "rope fused": (True, 8 << 20, 0, 0, 4),
    "fused+down skinny": (True, 10 << 20, 0, 0, 4),
    "fused+prefetch": (True, 8 << 20, ALWAYS, 32 << 20, 4),
    "fused+prefetch 16MB": (True, 8 << 20, ALWAYS, 16 << 20, 4),
    "fused+prefetch+down skinny": (True, 10 << 20, ALWAYS, 32 << 20, 4),
    "fused 8 warps": (True, 8 << 20, 0, 0, 8),
    "norm apart": (True, 8 << 20, 0, 0, 4, False),
    "norm tail 4k": (True, 8 << 20, 0, 0, 4, True, 4096),
    "norm tail 8k": (True, 8 << 20, 0, 0, 4, True, 8192),
}


def apply(core, name: str) -> None:
    ops = core.ops
    ops.fuse_rope, ops.skinny_max_bytes, ops.prefetch_rows, ops.prefetch_bytes, ops.attention_warps, *norm = VARIANTS[name]
    ops.norm_tail, ops.norm_tile = (norm + [8192])[:2] if norm else (False, 8192)


def main() -> None:
    alternate(*cli(VARIANTS, [16, 256, 1, 64]), apply, describe=greedy_tail)


if __name__ == "__main__":
    main()
