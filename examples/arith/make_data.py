"""Deterministic data generator for the tiny arithmetic RL task.

Writes three JSONL files into an output directory (default: ``data/`` beside
this script), one row per line: ``{"prompt": "37+48=", "answer": "85"}``.

* ``test.jsonl``  -- held-out prompts (disjoint from train/sft), for greedy eval.
* ``train.jsonl`` -- all remaining prompts, the RL prompt pool.
* ``sft.jsonl``   -- a small subset of ``train.jsonl`` used for the supervised
  warm-up (kept small on purpose so the warmed-up model is weak, not solved).

The problem space is every ``a+b`` with ``0 <= a, b <= 99`` (10,000 prompts).
Output depends only on ``--seed`` and the size flags.

Usage::

    python make_data.py                      # -> ./data/{train,test,sft}.jsonl
    python make_data.py --out /tmp/arith --seed 0 --n-test 500 --n-sft 2000
"""

import argparse
import json
import os
import random


def all_problems(max_operand=99):
    probs = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            probs.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return probs


def split(seed=0, n_test=500, n_sft=2000, max_operand=99):
    probs = all_problems(max_operand)
    rng = random.Random(seed)
    rng.shuffle(probs)
    test = probs[:n_test]
    train = probs[n_test:]
    sft = train[:n_sft]
    return train, test, sft


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-test", type=int, default=500)
    p.add_argument("--n-sft", type=int, default=2000)
    p.add_argument("--max-operand", type=int, default=99)
    a = p.parse_args()
    train, test, sft = split(a.seed, a.n_test, a.n_sft, a.max_operand)
    os.makedirs(a.out, exist_ok=True)
    for name, rows in (("train", train), ("test", test), ("sft", sft)):
        write_jsonl(os.path.join(a.out, f"{name}.jsonl"), rows)
        print(f"wrote {len(rows)} rows to {os.path.join(a.out, name + '.jsonl')}")


if __name__ == "__main__":
    main()
