"""A one-off experiment (2026-12-02; its knob exists at commit a33c6bf only,
so run it there): the decode step at small batches with the MLP's products
(cuBLAS) run at more rows than the batch has (the norm before them writes a padded output; the
rows past the batch are dropped after the down product), since cuBLAS picks its kernel, and how
many SMs it uses, by the row count: at 16 rows the gate/up product of the 0.5B shape runs on 76
of 132 SMs. Alternating in one process on one model (step time = (a call making 128 tokens - a
call making 1) / 127, the median of 3, graphs captured again for each variant).

    python bench/experiments/mlp_rows.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli  # noqa: E402

BASE = dict(mlp_pad_rows=0)
VARIANTS = {
    "rows as they are": {},
    "mlp at 24 rows": dict(mlp_pad_rows=24),
    "mlp at 32 rows": dict(mlp_pad_rows=32),
    "mlp at 48 rows": dict(mlp_pad_rows=48),
    "mlp at 64 rows": dict(mlp_pad_rows=64),
}


def apply(core, name: str) -> None:
    for knob, value in {**BASE, **VARIANTS[name]}.items():
        setattr(core.ops, knob, value)


def main() -> None:
    alternate(*cli(VARIANTS, [16, 8, 1]), apply)

if __name__ == "__main__":
    main()
