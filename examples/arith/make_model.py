"""Regenerate the example's small policy: a char-level Llama decoder warmed up by SFT on arithmetic.

The RL example needs a model that is weak but not hopeless at 2-digit addition, so that GRPO has
something to improve. This script makes one from scratch with rlfleet's own parts
(`services/trainer/warmup.py`): a character tokenizer, a random Llama-family model saved as a
Hugging Face directory, and a short supervised warm-up through the torch trainer backend. The
result is written to `model/` beside this script and committed, so `rlfleet run` needs no
download. Deterministic for a seed on one CPU thread.

    python examples/arith/make_model.py            # data/ must exist: python examples/arith/make_data.py
"""

from __future__ import annotations

import sys
from pathlib import Path

from services.trainer import warmup

HERE = Path(__file__).resolve().parent
CHARS = "0123456789+-="


def main(argv: list[str] | None = None) -> int:
    return warmup.main(argv, description=__doc__.splitlines()[0], here=HERE,
                       segments=lambda r: [(r["answer"], True)], chars=CHARS, max_positions=64, steps=300)


if __name__ == "__main__":
    sys.exit(main())
