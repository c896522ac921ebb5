"""What a generation call asks for and what it returns, shared by every engine.

`Sampling` is one call's settings (validated on construction, so a bad value is a ValueError
naming the field) and `Generation` one sampled completion. Conventions every engine keeps, so a
trainer can consume results without re-deriving them:

- `logprobs[k]` is log_softmax of the *raw* model logits (temperature 1, no top-k / top-p) at
  output token k: the trainer recomputes exactly this quantity, and the RL loss compares the two.
- `output_ids` include the token that ended the sequence (eos or a stop token id), with its
  logprob, so the policy also learns to stop. `text` is decoded with special tokens skipped.
- On a stop string, `output_ids` keep every token up to and including the one that completed it,
  and `text` is cut right after the stop string (a multi-character token may reach past it).
"""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy

MAX_SAMPLES_PER_PROMPT = 1024
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """Sampling settings for one `generate` call. temperature 0 means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature: {self.temperature} would overflow the scaled logits; use 0 for greedy "
                             f"decoding or at least {MIN_TEMPERATURE}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not 1 <= self.n <= MAX_SAMPLES_PER_PROMPT:
            raise ValueError(f"n: must be in [1, {MAX_SAMPLES_PER_PROMPT}], got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty")


@dataclass(frozen=True)
class Generation:
    """One sampled completion of prompt `prompt_index`; finish_reason is "stop", "length" or
    "abort" (a weight update ended it: its tokens so far). `versions`: (weight version, tokens)
    runs, in order, covering output_ids, where the engine reports them (empty: not reported)."""

    prompt_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    versions: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class EngineLoad:
    """What an engine's running batch holds now, and counters over its life (`GetStatus`): the
    queue depth a scaler or a coordinator reads, and how well rounds are filled."""

    rows_running: int = 0
    rows_waiting: int = 0  # admitted to no batch yet (preempted rows included)
    requests_live: int = 0
    rounds: int = 0  # host looks at the batch
    decode_steps: int = 0
    row_steps: int = 0  # rows in the batch summed over decode steps
    prefills: int = 0  # prefill forwards
    preempted: int = 0  # rows preempted
    prefix_lookup_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, found there
    prefill_s: float = 0.0  # admitting and prefilling
    decode_s: float = 0.0  # decode steps, up to the host seeing their results
    host_s: float = 0.0  # the rest of the rounds' host work


@dataclass(frozen=True, eq=False)
class PackedPrompts:
    """The prompts' ids one after another in one int64 array: prompt i is
    flat[starts[i] : starts[i] + lengths[i]]. `validate_prompts` converts the Python ints once to
    check them and returns this, so that an engine moving the ids to a device does not convert
    them a second time (~0.5 ms for 256 prompts of 64 tokens on a 2-core host, before the device
    gets its first work of a call)."""

    flat: numpy.ndarray  # int64 [all the ids]
    starts: numpy.ndarray  # int64 [prompts]
    lengths: numpy.ndarray  # int64 [prompts]

    def rows(self, indices: Sequence[int], width: int, fill: int = 0) -> numpy.ndarray:
        """int64 [len(indices), width]: prompts `indices`, each right-padded with `fill`."""
        index = numpy.asarray(indices, dtype=numpy.int64)
        lengths = self.lengths[index]
        if lengths.size and int(lengths.max()) > width:
            raise ValueError(f"PackedPrompts.rows: a prompt of {int(lengths.max())} ids does not fit in {width}")
        columns = numpy.arange(width, dtype=numpy.int64)
        real = columns < lengths[:, None]
        if not self.flat.size:  # (no ids at all: nothing to gather from)
            return numpy.full((len(index), width), fill, dtype=numpy.int64)
        at = numpy.where(real, self.starts[index][:, None] + columns, 0)
        return numpy.where(real, self.flat[at], fill)

    def prompt(self, index: int) -> list[int]:
        """Prompt `index`'s ids as Python ints."""
        start = int(self.starts[index])
        return self.flat[start : start + int(self.lengths[index])].tolist()

    def as_lists(self, prompts_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """The prompts these were packed from as lists of Python ints: the caller's own lists as
        they are, other sequences (tuples, numpy arrays, torch tensors) made from the packed ids."""
        return [p if type(p) is list else self.prompt(i) for i, p in enumerate(prompts_ids)]


def pack_prompts(prompts_ids: Sequence[Sequence[int]]) -> PackedPrompts:
    """`PackedPrompts` of any sequences of integers: lists, tuples, ranges, numpy arrays, torch
    tensors (TypeError or OverflowError for anything else)."""
    flat = array.array("q")
    lengths = []
    for prompt in prompts_ids:
        ids = _ids(prompt)
        flat.fromlist(ids)
        lengths.append(len(ids))
    return _packed(flat, lengths)


def _ids(prompt) -> list:
    """A prompt as a list: itself, what its `tolist` gives (numpy arrays, torch tensors: Python
    ints, not numpy or torch scalars), or list(prompt)."""
    if type(prompt) is list:
        return prompt
    tolist = getattr(prompt, "tolist", None)
    return tolist() if callable(tolist) else list(prompt)


def _packed(flat: array.array, lengths: list[int]) -> PackedPrompts:
    sizes = numpy.array(lengths, dtype=numpy.int64)
    starts = numpy.zeros_like(sizes)
    numpy.cumsum(sizes[:-1], out=starts[1:])
    ids = numpy.frombuffer(flat, dtype=numpy.int64) if len(flat) else numpy.zeros(0, dtype=numpy.int64)
    return PackedPrompts(ids, starts, sizes)


def validate_prompts(prompts_ids: Sequence[Sequence[int]], sampling: Sampling, vocab_size: int,
                     max_positions: int) -> PackedPrompts:
    """ValueError naming the field for prompts a model cannot take; the prompts packed if it can."""
    packed = _plainly_valid(prompts_ids, sampling, vocab_size, max_positions)
    if packed is None:  # a bad prompt, or prompts that are not all lists (tuples, arrays, tensors)
        _find_invalid(prompts_ids, sampling, vocab_size, max_positions)
        packed = pack_prompts(prompts_ids)
    if any(not 0 <= t < vocab_size for t in sampling.stop_token_ids):
        raise ValueError(f"stop_token_ids: ids must be in [0, {vocab_size})")
    return packed


def _plainly_valid(prompts_ids: Sequence[Sequence[int]], sampling: Sampling, vocab_size: int,
                   max_positions: int) -> PackedPrompts | None:
    """The prompts packed, if every one is a non-empty list of integers in [0, vocab_size) within
    the positions: checked in one pass through an int64 array (0.2 against 0.7 ms for 256 prompts
    of 64 tokens on a 2-core host, time before the device gets any work); None to let
    `_find_invalid` name the prompt."""
    flat = array.array("q")
    try:
        lengths = list(map(len, prompts_ids))
        if lengths and (min(lengths) == 0 or max(lengths) + sampling.max_new_tokens > max_positions):
            return None
        for prompt in prompts_ids:
            flat.fromlist(prompt)
    except (TypeError, OverflowError):
        return None
    packed = _packed(flat, lengths)
    if packed.flat.size and not (packed.flat.min() >= 0 and packed.flat.max() < vocab_size):
        return None
    return packed


def _find_invalid(prompts_ids: Sequence[Sequence[int]], sampling: Sampling, vocab_size: int,
                  max_positions: int) -> None:
    for i, prompt in enumerate(prompts_ids):
        try:
            ids = _ids(prompt)
        except TypeError:
            ids = None
        if not isinstance(ids, list):
            raise ValueError(f"prompts_ids: prompt {i} is not a sequence of token ids ({type(prompt).__name__})")
        if not ids:
            raise ValueError(f"prompts_ids: prompt {i} is empty")
        if not all(isinstance(t, int) for t in ids):
            raise ValueError(f"prompts_ids: prompt {i} holds token ids that are not integers")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompts_ids: prompt {i} has token ids outside [0, {vocab_size})")
        if len(ids) + sampling.max_new_tokens > max_positions:
            raise ValueError(
                f"max_new_tokens: prompt {i} has {len(ids)} tokens, and {len(ids)} + "
                f"{sampling.max_new_tokens} exceeds max_position_embeddings={max_positions}"
            )
