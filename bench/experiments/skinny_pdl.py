"""A one-off experiment (2026-12-02): the decode step at small batches with its products on cuBLAS
or on `_skinny_linear_kernel`, and with or without programmatic dependent launch (PDL), alternating
in one process on one model. The step time is (a call making 128 tokens - a call making 1) / 127,
the median of 3, graphs captured again for each variant.

    python bench/experiments/skinny_pdl.py   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import FULL, alternate, cli  # noqa: E402

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
    # Later still (RoPE inside attention, 5a584f6 on): the kernel with row tiles of 32 or 64 for
    # q/k/v and o at any batch, against cuBLAS past 16 rows
    "rows<=16": (16, True, 64, 128, 4, 3, 8 << 20),
    "rows<=256": (256, True, 64, 128, 4, 3, 8 << 20),
    "rows<=64": (64, True, 64, 128, 4, 3, 8 << 20),
    # and the MLP's down product too (the 0.5B's is 8.7 MB; SiLU read in), or every product
    "rows<=256 <=10MB": (256, True, 64, 128, 4, 3, 10 << 20),
    "rows<=256 all": (256, True, 64, 128, 4, 3, 1 << 40),
    # Later the same day a variant of the kernel loading its weight tile whole before the wait
    # ("resident <=8MB", "resident <=10MB", "resident all", "resident all silu apart", "resident
    # all k512" in bench/results/skinny_pdl-experiment-{5,6}-*.txt) was measured; it did not pay
    # and was taken out, so those variants run only at commit 2f73e50.
}


def apply(core, name: str) -> None:
    values = dict(zip(KNOBS, VARIANTS[name]))
    values.setdefault("skinny_max_bytes", 1 << 40)
    for knob, value in values.items():
        setattr(core.ops, knob, value)


def first_tokens(core, prompts) -> str:
    return f"first tokens {[r.output_ids[:4] for r in core.generate(prompts[:2], FULL)]}"


def main() -> None:
    alternate(*cli(VARIANTS, [16, 1]), apply, describe=first_tokens)

if __name__ == "__main__":
    main()
