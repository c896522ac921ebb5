"""2-digit products with a calculator tool, as chat conversations, for SmolLM2-135M-Instruct.

Writes beside `make_data.py`'s files (default `data/`):

* `agent_train.jsonl`, `agent_test.jsonl`: `{"messages": [system, user], "answer": "1776"}`. The
  system turn describes the calculator in the Hermes / Qwen `<tool_call>` format; the user asks
  for a product. The held-out split shares no (a, b) pair with the training split.
* `agent_sft.jsonl`: whole conversations for the job's warm-up (`sft.conversations`), each ending
  with the assistant's answer. A fraction `--tool-frac` call the tool first (assistant call, tool
  reply, assistant answer); the rest answer directly. The loss is on the assistant turns only.

    python examples/smollm2/make_agent_data.py [--out examples/smollm2/data] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = ('You can use a calculator. To call it, reply with <tool_call>{"name": "calculator", "arguments": '
          '{"expression": "..."}}</tool_call>; its result comes back in <tool_response></tool_response>. '
          'Reply with the number only.')
QUESTIONS = ["What is {a} times {b}?", "Compute {a}*{b}.", "How much is {a} multiplied by {b}?"]


def conversation(a: int, b: int, question: str, tool: bool) -> list[dict]:
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question.format(a=a, b=b)}]
    if tool:
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}})
        turns += [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                  {"role": "tool", "content": f"<tool_response>{a * b}</tool_response>"}]
    return turns + [{"role": "assistant", "content": str(a * b)}]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-test", type=int, default=300)
    parser.add_argument("--n-sft", type=int, default=2000)
    parser.add_argument("--tool-frac", type=float, default=0.3)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    test, train = pairs[: args.n_test], pairs[args.n_test :]

    def row(a, b):
        q = rng.choice(QUESTIONS)
        return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q.format(a=a, b=b)}],
                "answer": str(a * b)}

    sft = [{"messages": conversation(a, b, rng.choice(QUESTIONS), rng.random() < args.tool_frac)}
           for a, b in train[: args.n_sft]]
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("agent_train", [row(*p) for p in train]), ("agent_test", [row(*p) for p in test]),
                       ("agent_sft", sft)):
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {len(rows)} rows to {args.out / name}.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
