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

import argparse
import json
import sys
from pathlib import Path

from services.trainer.warmup import sft_warmup

HERE = Path(__file__).resolve().parent
CHARS = "0123456789+-="


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE / "data" / "sft.jsonl")
    parser.add_argument("--out", type=Path, default=HERE / "model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    sft_warmup(args.out, [(r["prompt"], [(r["answer"], True)]) for r in rows], chars=CHARS, seed=args.seed,
               hidden=args.hidden, layers=args.layers, heads=args.heads, max_positions=64, steps=args.steps,
               batch_size=args.batch_size, lr=args.lr)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
