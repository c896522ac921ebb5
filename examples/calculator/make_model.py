"""Regenerate the calculator example's policy: a char-level Llama warmed up on tool syntax.

The warm-up (`services/trainer/warmup.py`) shows the model 2-digit products answered two ways:
mostly directly (a guess, for a model this small), and on a few rows (``tool`` in
``data/sft.jsonl``) through a calculator call in the Hermes / Qwen format, the tool's answer,
and the answer copied from it:

    37*48=<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>
          <tool_response>1776</tool_response>1776<eos>

The tool's answer is read, not trained on (loss mask 0), as in the RL episodes. `<tool_call>`,
`</tool_call>`, `<tool_response>` and `</tool_response>` are single tokens, as in Qwen's
vocabulary. The result goes to `model/` beside this script and is committed, so the job needs no
download. Deterministic for a seed on one CPU thread.

    python examples/calculator/make_data.py && python examples/calculator/make_model.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from services.trainer import warmup

HERE = Path(__file__).resolve().parent
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"  # printable ASCII: every tool reply can be read
WORDS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def tool_call(expression: str) -> str:
    return f'<tool_call>{json.dumps({"name": "calculator", "arguments": {"expression": expression}})}</tool_call>'


def segments(row: dict) -> list[tuple[str, bool]]:
    if not row["tool"]:
        return [(row["answer"], True)]
    return [(tool_call(row["prompt"].rstrip("=")), True),
            (f"<tool_response>{row['answer']}</tool_response>", False),
            (row["answer"], True)]


def main(argv: list[str] | None = None) -> int:
    return warmup.main(argv, description=__doc__.splitlines()[0], here=HERE, segments=segments, chars=CHARS, words=WORDS,
                       max_positions=128, steps=600)


if __name__ == "__main__":
    sys.exit(main())
