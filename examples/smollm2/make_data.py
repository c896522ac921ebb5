"""Arithmetic word problems as chat conversations, for GRPO on SmolLM2-135M-Instruct.

Each row is `{"messages": [{"role": "user", "content": ...}], "answer": "42"}`: the coordinator
renders the messages with the checkpoint's own chat template, and the math reward checks the
number in the reply (a `\\boxed{}` one first). Sums and differences of two numbers up to 60, in a
few phrasings; the held-out split shares no (phrasing, numbers) pair with the training split.

    python examples/smollm2/make_data.py [--out examples/smollm2/data] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Tom", "Ana", "Wei", "Sara", "Omar", "Lena", "Ravi", "Maya"]
THINGS = ["apples", "books", "coins", "marbles", "stickers", "pencils"]
TEMPLATES = [
    ("{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", lambda a, b: a + b),
    ("{name} had {a} {thing} and gave away {b}. How many {thing} are left?", lambda a, b: a - b),
    ("What is {a} plus {b}?", lambda a, b: a + b),
    ("A box holds {a} {thing}. Another box holds {b}. How many {thing} are there in total?", lambda a, b: a + b),
]
INSTRUCTION = " Reply with the number only."


def problems(seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index, (template, solve) in enumerate(TEMPLATES):
        for a in range(2, 61):
            for b in range(1, 31):
                if solve(a, b) < 0:
                    continue
                text = template.format(name=rng.choice(NAMES), thing=rng.choice(THINGS), a=a, b=b)
                rows.append({"messages": [{"role": "user", "content": text + INSTRUCTION}],
                             "answer": str(solve(a, b)), "template": index})
    rng.shuffle(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-test", type=int, default=300)
    args = parser.parse_args(argv)
    rows = problems(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("test", rows[: args.n_test]), ("train", rows[args.n_test :])):
        with open(args.out / f"{name}.jsonl", "w") as f:
            for row in part:
                f.write(json.dumps(row) + "\n")
    print(f"wrote {len(rows) - args.n_test} train and {args.n_test} test rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
