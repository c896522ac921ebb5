"""Prompt datasets: JSON-lines loading and a resumable, seeded batch sampler.

Rows are JSON objects with a prompt and a reference answer under configurable keys. Loading is
strict and names the file and line of the first bad row. `PromptSampler` deals batches from
epochs of shuffled rows; an epoch's order depends only on (seed, epoch), so its state is just
(epoch, position) and a resumed job continues with exactly the batches it would have drawn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file (and line)."""


@dataclass(frozen=True)
class Example:
    """One row: its prompt, its reference answer, and its 0-based index among the file's rows."""

    prompt: str
    answer: str
    index: int


def load_jsonl(path: str | Path, prompt_key: str, answer_key: str, limit: int | None = None) -> list[Example]:
    """Read up to `limit` rows (all when None) of a JSON-lines file; blank lines are skipped.

    Prompts must be strings; answers may be strings or numbers (a JSON `42` becomes `"42"`).
    """
    path = Path(path)
    examples: list[Example] = []
    try:
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if limit is not None and len(examples) >= limit:
                    break
                if not line.strip():
                    continue
                examples.append(_parse_row(path, line_no, line, prompt_key, answer_key, len(examples)))
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e})") from e
    if not examples:
        raise DatasetError(f"{path}: no rows")
    return examples


def _parse_row(path: Path, line_no: int, line: str, prompt_key: str, answer_key: str, index: int) -> Example:
    where = f"{path}:{line_no}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in (prompt_key, answer_key):
        if key not in row:
            raise DatasetError(f"{where}: missing key {key!r} (row has {', '.join(map(repr, row)) or 'no keys'})")
    prompt, answer = row[prompt_key], row[answer_key]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: {prompt_key!r} must be a string, got {_kind(prompt)}")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DatasetError(f"{where}: {answer_key!r} must be a string or a number, got {_kind(answer)}")
    return Example(prompt=prompt, answer=str(answer), index=index)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


class PromptSampler:
    """Deals batches of examples, epoch after epoch, deterministically for a seed.

    Every example appears once per epoch; a batch that reaches the end of an epoch continues
    into the next one (so with fewer rows than batch_size a batch repeats rows). Without
    shuffle every epoch is in file order.
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not examples:
            raise ValueError("examples: need at least one example")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into the current epoch's order
        self._order = self._epoch_order(0)

    def next_batch(self) -> list[Example]:
        batch: list[Example] = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self.position)
            batch += [self.examples[i] for i in self._order[self.position : self.position + take]]
            self.position += take
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved state; refuses a state saved for another seed or dataset size."""
        if state.get("num_examples", len(self.examples)) != len(self.examples):
            raise ValueError(
                f"sampler state: saved for {state['num_examples']} examples, this dataset has {len(self.examples)}"
            )
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"sampler state: saved for seed {state['seed']}, this sampler has seed {self.seed}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.examples):
            raise ValueError(f"sampler state: epoch {epoch}, position {position} out of range")
        self.epoch, self.position = epoch, position
        self._order = self._epoch_order(epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.examples)))
        # Seeding with (seed, epoch) makes every epoch's order reproducible without replaying earlier ones.
        rng = np.random.default_rng([self.seed % 2**64, epoch])  # SeedSequence wants non-negative ints
        return rng.permutation(len(self.examples)).tolist()
