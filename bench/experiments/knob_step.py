"""The decode step at each value of one `TritonOps` knob, alternating in one process on one model
(see `alternate.py`): the screening loop for a setting that needs no code of its own.

    python bench/experiments/knob_step.py attention_preload_max_splits=0,4 [batches] [shapes]   # on a GPU
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, greedy_tail  # noqa: E402
from services.rollout.builtin.kernels import TritonOps  # noqa: E402


def main() -> None:
    knob, values = sys.argv[1].split("=")
    if not hasattr(TritonOps, knob):
        raise SystemExit(f"TritonOps has no knob {knob!r}")
    names = [f"{knob}={v}" for v in values.split(",")]
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [256, 64, 16]

    def apply(core, name: str) -> None:
        setattr(core.ops, knob, ast.literal_eval(name.split("=", 1)[1]))

    shapes = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ("0.5b", "1.5b")
    alternate(names, batches, apply, describe=greedy_tail, shapes=shapes)


if __name__ == "__main__":
    main()
