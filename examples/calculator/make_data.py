"""Deterministic data for the calculator-tool example: 2-digit multiplication.

Writes three JSONL files (default: ``data/`` beside this script), one row per line,
``{"prompt": "37*48=", "answer": "1776"}``:

* ``test.jsonl``  -- held-out prompts (disjoint from the others), for greedy eval;
* ``train.jsonl`` -- the rest, the RL prompt pool;
* ``sft.jsonl``   -- a subset of train for the supervised warm-up, each row marked ``tool``: true
  where the warm-up shows a calculator call and false where it shows a direct answer. Few rows
  show the call (``--tool-frac``), so the warmed-up model seldom calls the tool and RL has to
  find that calling it pays.

The problem space is every ``a*b`` with ``10 <= a, b <= 99`` (8,100 prompts), which a model this
small cannot multiply in its head. Output depends only on the flags.

    python examples/calculator/make_data.py
"""

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--n-sft", type=int, default=4000)
    p.add_argument("--tool-frac", type=float, default=0.15)
    a = p.parse_args()
    rows = [{"prompt": f"{x}*{y}=", "answer": str(x * y)} for x in range(10, 100) for y in range(10, 100)]
    rng = random.Random(a.seed)
    rng.shuffle(rows)
    test, train = rows[: a.n_test], rows[a.n_test :]
    sft = [{**r, "tool": rng.random() < a.tool_frac} for r in train[: a.n_sft]]
    a.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("test", test), ("sft", sft)):
        (a.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"wrote {len(part)} rows to {a.out / name}.jsonl")


if __name__ == "__main__":
    main()
