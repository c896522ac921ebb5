"""Prompt datasets as users keep them: JSON lines, Parquet, Hugging Face `save_to_disk` folders.

A row becomes an `Example`: a prompt (a string) or a conversation (`messages`, a list of
`{role, content}` turns), a reference answer, and optional metadata (chosen columns, handed to
the reward). `Columns` says which keys to read. The format follows the path: a directory is a
`datasets` `save_to_disk` folder (its Arrow files are read with pyarrow; `datasets` itself is
never imported), `.parquet`/`.pq` is Parquet, anything else is JSON lines.

Reading is strict: the first bad row (missing key, wrong type, unknown role, empty prompt)
raises `DatasetError` naming the file and the row — the 1-based line for JSON lines (as an
editor shows it), the 0-based row index for Parquet and Arrow (as pandas and `datasets` index
it). `check_dataset` streams every row through the same checks without keeping any, so a job is
refused at submit time, before a worker starts.

Memory: files are never read whole. `open_dataset` streams the file once to check it and keeps
an index; rows are parsed again when the sampler asks for them. For JSON lines the index is one
byte offset per row (8 bytes); a `save_to_disk` folder's Arrow files are memory-mapped (the page
cache holds them, not the heap); a Parquet file's prompt, answer and metadata columns are
streamed batch by batch into an unlinked temporary Arrow file (under $TMPDIR) that is
memory-mapped, since Parquet row groups are too coarse to seek to one row. `PromptSampler`
deals batches from epochs of shuffled row indices; an epoch's order depends only on (seed,
epoch), so its state is just (epoch, position) and a resumed job draws exactly the batches it
would have drawn.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

ROLES = ("system", "user", "assistant")
_BATCH_ROWS = 1024  # rows per Arrow record batch while streaming a Parquet or Arrow file
_PARQUET_SUFFIXES = (".parquet", ".pq")


class DatasetError(ValueError):
    """A dataset file is missing or malformed; the message names the file (and line or row)."""


@dataclass(frozen=True)
class Example:
    """One row: a prompt or a conversation (exactly one is set), the reference answer, the
    row's 0-based index among the file's rows, and the metadata columns the job asked for."""

    prompt: str | None
    answer: str
    index: int
    messages: list[dict[str, str]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert (self.prompt is None) != (self.messages is None), "exactly one of prompt and messages is set"


@dataclass(frozen=True, kw_only=True)
class Columns:
    """Which keys of a row hold what. With `messages_key` set, the prompt is read from it (a
    list of {role, content} turns) and `prompt_key` is not read."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    messages_key: str | None = None
    metadata_keys: tuple[str, ...] = ()
    # Whole conversations to learn from (SFT): messages_key's turns may include tool turns and end
    # with the assistant's; no answer is read.
    trajectories: bool = False

    @property
    def keys(self) -> tuple[str, ...]:
        """Every key a row must have, without repeats, in the order rows are checked."""
        first = self.messages_key if self.messages_key is not None else self.prompt_key
        answer = () if self.trajectories else (self.answer_key,)
        return tuple(dict.fromkeys((first, *answer, *self.metadata_keys)))


# --------------------------------------------------------------------------- public entry points


def open_dataset(path: str | Path, columns: Columns, limit: int | None = None) -> Sequence[Example]:
    """The first `limit` rows (all when None) of a dataset, checked now and read on demand."""
    path = Path(path)
    if path.is_dir():
        return _ArrowDataset(path, _arrow_table(_hf_arrow_files(path), path), columns, limit)
    if path.suffix.lower() in _PARQUET_SUFFIXES:
        return _ArrowDataset(path, _parquet_to_mapped_table(path, columns, limit), columns, limit)
    return _JsonlDataset(path, columns, limit)


def iter_examples(path: str | Path, columns: Columns, limit: int | None = None) -> Iterator[Example]:
    """Stream the first `limit` rows (all when None) of a dataset as Examples, one batch in memory."""
    path = Path(path)
    if path.is_dir():
        yield from _iter_arrow_rows(path, _hf_batches(path), columns, limit)
    elif path.suffix.lower() in _PARQUET_SUFFIXES:
        yield from _iter_arrow_rows(path, _parquet_batches(path, columns), columns, limit)
    else:
        for _, _, example in _iter_jsonl(path, columns, limit):
            yield example


def check_dataset(path: str | Path, columns: Columns, limit: int | None = None) -> int:
    """Check every row (up to `limit`) without keeping any; the number of rows, or DatasetError."""
    count = sum(1 for _ in iter_examples(path, columns, limit))
    if count == 0:
        raise DatasetError(f"{path}: no rows")
    return count


def load_examples(path: str | Path, columns: Columns, limit: int | None = None) -> list[Example]:
    """Every row (up to `limit`) parsed into memory: for small files (eval sets, SFT data)."""
    examples = list(iter_examples(path, columns, limit))
    if not examples:
        raise DatasetError(f"{path}: no rows")
    return examples


def load_jsonl(path: str | Path, prompt_key: str, answer_key: str, limit: int | None = None) -> list[Example]:
    """Read up to `limit` rows (all when None) of a JSON-lines file; blank lines are skipped.

    Prompts must be non-empty strings; answers may be strings or numbers (`42` becomes `"42"`).
    """
    examples = [e for _, _, e in _iter_jsonl(Path(path), Columns(prompt_key=prompt_key, answer_key=answer_key), limit)]
    if not examples:
        raise DatasetError(f"{path}: no rows")
    return examples


# --------------------------------------------------------------------------- one row


def to_example(row: Any, columns: Columns, index: int, where: str) -> Example:
    """Check one row (a mapping from keys to JSON-like values) and make it an Example."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {_kind(row)}")
    for key in columns.keys:
        if key not in row:
            raise DatasetError(f"{where}: missing key {key!r} (row has {', '.join(map(repr, row)) or 'no keys'})")
    prompt, messages = None, None
    if columns.messages_key is not None:
        messages = _messages(row[columns.messages_key], columns.messages_key, where, trajectory=columns.trajectories)
    else:
        prompt = row[columns.prompt_key]
        if not isinstance(prompt, str):
            raise DatasetError(f"{where}: {columns.prompt_key!r} must be a string, got {_kind(prompt)}")
        if not prompt.strip():
            raise DatasetError(f"{where}: {columns.prompt_key!r} is empty")
    answer = row.get(columns.answer_key, "") if columns.trajectories else row[columns.answer_key]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DatasetError(f"{where}: {columns.answer_key!r} must be a string or a number, got {_kind(answer)}")
    metadata = {}
    for key in columns.metadata_keys:
        _check_json(row[key], f"{where}: metadata key {key!r}")
        metadata[key] = row[key]
    return Example(prompt=prompt, answer=str(answer), index=index, messages=messages, metadata=metadata)


def _messages(value: Any, key: str, where: str, *, trajectory: bool = False) -> list[dict[str, str]]:
    """A conversation the policy answers: system first if at all, and a user turn last. A
    `trajectory` (SFT on whole conversations) may hold tool turns and ends with an assistant turn."""
    roles = (*ROLES, "tool") if trajectory else ROLES
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: {key!r} must be a non-empty list of {{role, content}} turns, got {_kind(value)}")
    turns = []
    for i, turn in enumerate(value):
        at = f"{where}: {key}[{i}]"
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DatasetError(f"{at}: expected {{role, content}}, got {_kind(turn) if not isinstance(turn, dict) else sorted(turn)}")
        role, content = turn["role"], turn["content"]
        if role not in roles:
            raise DatasetError(f"{at}: role must be one of {', '.join(roles)}, got {role!r}")
        if role == "system" and i > 0:
            raise DatasetError(f"{at}: a system turn may only come first")
        if not isinstance(content, str):
            raise DatasetError(f"{at}: content must be a string, got {_kind(content)}")
        turns.append({"role": role, "content": content})
    if trajectory:
        if turns[-1]["role"] != "assistant":
            raise DatasetError(f"{where}: {key!r} must end with an assistant turn (what SFT learns), "
                               f"got {turns[-1]['role']!r}")
        return turns
    if turns[-1]["role"] != "user":
        raise DatasetError(f"{where}: {key!r} must end with a user turn (the policy writes the next "
                           f"assistant turn), got {turns[-1]['role']!r}")
    if not turns[-1]["content"].strip():
        raise DatasetError(f"{where}: {key}[{len(turns) - 1}]: the last user turn is empty")
    return turns


def _check_json(value: Any, where: str) -> None:
    """Metadata travels to rewards (and over HTTP): it must be JSON data."""
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DatasetError(f"{where}: must be JSON data, got {value}")
        return
    if isinstance(value, list):
        for v in value:
            _check_json(v, where)
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for v in value.values():
            _check_json(v, where)
        return
    raise DatasetError(f"{where}: must be JSON data, got {_kind(value)}")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "list" if value else "an empty list"
    return type(value).__name__


# --------------------------------------------------------------------------- JSON lines


def _iter_jsonl(path: Path, columns: Columns, limit: int | None) -> Iterator[tuple[int, int, Example]]:
    """(byte offset, line number, example) per non-blank line, reading one line at a time."""
    count, offset = 0, 0
    try:
        with path.open("rb") as f:
            for line_no, raw in enumerate(f, start=1):
                start, offset = offset, offset + len(raw)
                if limit is not None and count >= limit:
                    return
                if not raw.strip():
                    continue
                yield start, line_no, _parse_line(path, line_no, raw, columns, count)
                count += 1
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from e


def _parse_line(path: Path, line_no: int, raw: bytes, columns: Columns, index: int) -> Example:
    where = f"{path}:{line_no}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: not UTF-8 text ({e})") from e
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
    return to_example(row, columns, index, where)


class _Rows(Sequence[Example]):
    """A dataset whose rows are converted one at a time (`_row`), by index or slice."""

    @overload
    def __getitem__(self, index: int) -> Example: ...
    @overload
    def __getitem__(self, index: slice) -> list[Example]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self._row(range(len(self))[index])  # IndexError past the end, negative indices allowed

    def _row(self, index: int) -> Example:
        raise NotImplementedError

    def take(self, indices: list[int]) -> list[Example]:
        """The rows at `indices` (in range), in order: a batch."""
        return [self._row(i) for i in indices]


class _JsonlDataset(_Rows):
    """JSON lines indexed by byte offset: a row is read again (one seek, one line) when asked for."""

    def __init__(self, path: Path, columns: Columns, limit: int | None) -> None:
        self.path, self.columns = path, columns
        starts, lines = array("q"), array("q")  # 8 bytes a row, not a Python int each
        for offset, line_no, _ in _iter_jsonl(path, columns, limit):
            starts.append(offset)
            lines.append(line_no)
        if not starts:
            raise DatasetError(f"{path}: no rows")
        self._offsets = np.frombuffer(starts, dtype=np.int64)  # [rows]
        self._lines = np.frombuffer(lines, dtype=np.int64)  # [rows]: errors name the line even now

    def __len__(self) -> int:
        return len(self._offsets)

    def _row(self, index: int) -> Example:
        try:
            with self.path.open("rb") as f:
                f.seek(int(self._offsets[index]))
                raw = f.readline()
        except OSError as e:
            raise DatasetError(f"{self.path}: cannot read ({e.strerror or e})") from e
        return _parse_line(self.path, int(self._lines[index]), raw, self.columns, index)

    def take(self, indices: list[int]) -> list[Example]:
        """The rows at `indices`, read through one open file (a batch of a thousand rows opened
        the file a thousand times)."""
        try:
            with self.path.open("rb") as f:
                raws = []
                for index in indices:
                    f.seek(int(self._offsets[index]))
                    raws.append(f.readline())
        except OSError as e:
            raise DatasetError(f"{self.path}: cannot read ({e.strerror or e})") from e
        return [_parse_line(self.path, int(self._lines[i]), raw, self.columns, i) for i, raw in zip(indices, raws)]

    def __iter__(self) -> Iterator[Example]:
        for _, _, example in _iter_jsonl(self.path, self.columns, len(self)):
            yield example


# --------------------------------------------------------------------------- Arrow and Parquet


def _pyarrow(what: str):
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401  (submodules the readers use)
        import pyarrow.parquet  # noqa: F401
    except ImportError as e:
        raise DatasetError(f"reading {what} needs the pyarrow package (pip install pyarrow)") from e
    return pyarrow


def _hf_arrow_files(directory: Path) -> list[Path]:
    """The Arrow files of a `save_to_disk` folder, in row order (as its state.json lists them)."""
    if (directory / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in directory.iterdir() if p.is_dir())
        raise DatasetError(f"{directory}: a DatasetDict; point at one split's folder ({', '.join(splits) or 'none found'})")
    state_file = directory / "state.json"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
        files = [directory / entry["filename"] for entry in state["_data_files"]]
    except FileNotFoundError:
        raise DatasetError(f"{directory}: not a Hugging Face datasets folder (no state.json; expected what "
                           "Dataset.save_to_disk writes, a .parquet file or a JSON-lines file)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"{state_file}: unreadable datasets state ({e})") from e
    for file in files:
        if not file.is_file():
            raise DatasetError(f"{directory}: {file.name} is listed in state.json but missing")
    return files


def _hf_batches(directory: Path) -> Iterator[tuple[str, Any]]:
    pa = _pyarrow("a datasets folder")
    for file in _hf_arrow_files(directory):
        try:
            with pa.memory_map(str(file)) as source:
                for batch in pa.ipc.open_stream(source):  # save_to_disk writes the IPC stream format
                    yield file.name, batch
        except pa.ArrowException as e:
            raise DatasetError(f"{file}: not an Arrow stream ({e})") from e


def _parquet_batches(path: Path, columns: Columns) -> Iterator[tuple[str, Any]]:
    """Record batches of the columns the job reads; only one batch is decoded at a time."""
    pa = _pyarrow("Parquet")
    try:
        parquet = pa.parquet.ParquetFile(str(path))
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror or e})") from e
    except pa.ArrowException as e:
        raise DatasetError(f"{path}: not a Parquet file ({e})") from e
    names = parquet.schema_arrow.names
    missing = [k for k in columns.keys if k not in names]
    if missing:
        raise DatasetError(f"{path}: missing column {missing[0]!r} (columns: {', '.join(map(repr, names))})")
    try:
        for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=list(columns.keys)):
            yield "", batch
    except pa.ArrowException as e:
        raise DatasetError(f"{path}: corrupt Parquet data ({e})") from e


def _iter_arrow_rows(path: Path, batches: Iterator[tuple[str, Any]], columns: Columns,
                     limit: int | None) -> Iterator[Example]:
    index, first = 0, True
    for file, batch in batches:
        if first:
            _check_schema(path, batch.schema.names, columns)
            first = False
        for row in batch.to_pylist():
            if limit is not None and index >= limit:
                return
            where = f"{path}{'/' + file if file else ''}: row {index}"
            yield to_example(row, columns, index, where)
            index += 1


def _check_schema(path: Path, names: list[str], columns: Columns) -> None:
    missing = [k for k in columns.keys if k not in names]
    if missing:  # one message for the file, not a "missing key" for each of its rows
        raise DatasetError(f"{path}: missing column {missing[0]!r} (columns: {', '.join(map(repr, names))})")


def _arrow_table(files: list[Path], path: Path):
    """One zero-copy table over memory-mapped Arrow stream files."""
    pa = _pyarrow("a datasets folder")
    try:
        tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all() for f in files]
    except pa.ArrowException as e:
        raise DatasetError(f"{path}: not a readable Arrow stream ({e})") from e
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _parquet_to_mapped_table(path: Path, columns: Columns, limit: int | None):
    """The needed columns of a Parquet file, copied batch by batch into an unlinked temporary
    Arrow file and memory-mapped: random rows without holding the file in the heap."""
    pa = _pyarrow("Parquet")
    batches = _parquet_batches(path, columns)
    fd, tmp = tempfile.mkstemp(prefix="rlfleet-rows-", suffix=".arrow")
    os.close(fd)
    try:
        writer, written = None, 0
        for _, batch in batches:
            if limit is not None:
                batch = batch.slice(0, max(0, limit - written))
            if writer is None:
                writer = pa.ipc.new_file(tmp, batch.schema)
            writer.write_batch(batch)
            written += batch.num_rows
            if limit is not None and written >= limit:
                break
        if writer is None:
            raise DatasetError(f"{path}: no rows")
        writer.close()
        table = pa.ipc.open_file(pa.memory_map(tmp)).read_all()
    finally:
        os.unlink(tmp)  # the mapping keeps the data; the file goes when the table does
    return table


class _ArrowDataset(_Rows):
    """Rows of an Arrow table (memory-mapped), checked once by streaming, converted on demand."""

    def __init__(self, path: Path, table: Any, columns: Columns, limit: int | None) -> None:
        self.path, self.columns = path, columns
        _check_schema(path, table.schema.names, columns)
        table = table.select(list(columns.keys))
        self._table = table.slice(0, limit) if limit is not None else table
        if self._table.num_rows == 0:
            raise DatasetError(f"{path}: no rows")
        for _ in _iter_arrow_rows(path, (("", b) for b in self._table.to_batches(_BATCH_ROWS)), columns, None):
            pass  # every row is checked now, so a bad one fails before the job starts

    def __len__(self) -> int:
        return self._table.num_rows

    def _row(self, index: int) -> Example:
        (row,) = self._table.slice(index, 1).to_pylist()
        return to_example(row, self.columns, index, f"{self.path}: row {index}")

    def __iter__(self) -> Iterator[Example]:
        yield from _iter_arrow_rows(self.path, (("", b) for b in self._table.to_batches(_BATCH_ROWS)), self.columns, None)


# --------------------------------------------------------------------------- sampling


class PromptSampler:
    """Deals batches of examples, epoch after epoch, deterministically for a seed.

    Every example appears once per epoch; a batch that reaches the end of an epoch continues
    into the next one (so with fewer rows than batch_size a batch repeats rows). Without
    shuffle every epoch is in file order. `examples` may be any sequence (an `open_dataset`
    result reads rows only as they are dealt); the sampler keeps one epoch's order of indices.
    """

    def __init__(self, examples: Sequence[Example], batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not len(examples):
            raise ValueError("examples: need at least one example")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # index into the current epoch's order
        self.batches_dealt = 0  # next_batch calls so far (skipped ones included): where a resumed job goes on
        self._order = self._epoch_order(0)

    def next_batch(self) -> list[Example]:
        self.batches_dealt += 1
        batch: list[Example] = []
        while len(batch) < self.batch_size:
            if self.position == len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self.position)
            indices = self._order[self.position : self.position + take].tolist()
            rows = getattr(self.examples, "take", None)  # a file's dataset reads a batch at once
            batch += rows(indices) if rows is not None else [self.examples[i] for i in indices]
            self.position += take
        return batch

    def skip_batches(self, num_batches: int) -> None:
        """Advance as `num_batches` calls of next_batch would, without reading any row."""
        self.batches_dealt += num_batches
        for _ in range(num_batches):
            need = self.batch_size
            while need:
                if self.position == len(self._order):
                    self.epoch += 1
                    self.position = 0
                    self._order = self._epoch_order(self.epoch)
                take = min(need, len(self._order) - self.position)
                self.position += take
                need -= take

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

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """The epoch's row indices, [num_examples] int64 (8 bytes a row, not a Python list)."""
        if not self.shuffle:
            return np.arange(len(self.examples), dtype=np.int64)
        # Seeding with (seed, epoch) makes every epoch's order reproducible without replaying earlier ones.
        rng = np.random.default_rng([self.seed % 2**64, epoch])  # SeedSequence wants non-negative ints
        return rng.permutation(len(self.examples))
