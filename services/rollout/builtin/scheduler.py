"""Continuous batching for one generate call: which prompts run, when, and when a row is finished.

The scheduler owns the host's view of the batch: the rows in their slots, the prompts still
waiting, and every row's blocks. Each round it admits waiting prompts into free slots while
their blocks fit (one prefill for a prompt's `n` samples, which share the blocks the prompt
fills; prompts are admitted once a quarter of the slots is free, so prefills come in batches),
lets the runner decode a few steps with no host sync, then reads which rows are done,
looks for stop strings, hands finished rows back as `Generation`s, frees their blocks and packs
the rest to the front. So a long-tail row never keeps a slot from a waiting prompt for longer
than one round. Handing rows back is split in two: their outputs are copied out and their
blocks freed before the rest are packed, and the host work (lists, text, `Generation`s) is done
while the next round's decode steps run, not while the device waits for it.

The host's own work is kept off the device's critical path: a prefill is queued before its rows'
records are made; rows that nothing but their length limit can end are never read (the host
knows when they finish), and their outputs so far are turned into lists a round at a time while
later steps run, so that little is left for the end of the call, when the device is idle.

A row reserves blocks for its prompt plus max_new_tokens when admitted: it can never run out
mid-way, so nothing is ever preempted or recomputed.
"""

from __future__ import annotations

import gc
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from services.models.tokenizer import Tokenizer
from services.rollout.builtin import sampling
from services.rollout.builtin.kv_cache import PagedKVCache
from services.rollout.builtin.runner import ModelRunner, NewRow, StepMode
from services.rollout.types import Generation, PackedPrompts, Sampling, pack_prompts


MAX_UNCHECKED_STEPS = 64  # decode steps between host checks at most, when rows cannot stop early
# When rows cannot stop early, the round before the first of them finishes ends this many steps
# short of it: their outputs up to there become lists while those last steps run, so that few
# are left to convert when the device is done (`Scheduler._outputs_so_far`).
LAST_ROUND_STEPS = 8


def _timed(hand_back: Callable[[], float]) -> tuple[float, float]:
    """Seconds `hand_back()` took, and of those the seconds it waited for the device (it says)."""
    started = time.perf_counter()
    waited = hand_back()
    return time.perf_counter() - started, waited


class _Collections:
    """Python's cyclic garbage collector kept out of the moments the device waits for the host.

    Left to itself, a collection starts at whatever allocation crosses its threshold: during an
    admission or after the call's last step (a collection over fresh lists took ~0.9 ms there on
    an H200 machine's host), with the device idle. During a call it is off, and `collect_due`
    runs the collection Python would have run by then where the host has just queued decode
    steps, so it overlaps them. Off and on again as found: a caller that turned it off keeps it
    off."""

    def __init__(self) -> None:
        self.enabled = gc.isenabled()
        gc.disable()

    def restore(self) -> None:
        if self.enabled:
            gc.enable()

    def collect_due(self) -> None:
        if not self.enabled:
            return
        (young, middle, _), (young_limit, middle_limit, _) = gc.get_count(), gc.get_threshold()
        if young_limit and young > young_limit:
            gc.collect(1 if middle >= middle_limit else 0)  # the oldest generation waits for the call's end


class GenerationCancelled(RuntimeError):
    """The caller gave up (its RPC was cancelled or ran past its deadline)."""


class PromptTooLong(ValueError):
    """A prompt plus max_new_tokens needs more KV cache than the engine has."""


@dataclass
class _Row:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    blocks: list[int]  # the row's references: the prompt's shared blocks, then its own
    searched: int = 0  # output tokens already searched for stop strings
    # Its first outputs, already on the host (`Scheduler._outputs_so_far`); handing the row back
    # appends the rest and gives these lists to its `Generation`.
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class _Waiting:
    prompt_index: int
    prompt_ids: list[int]
    samples: list[int]  # sample indices not yet admitted


@dataclass(frozen=True)
class CallStats:
    rounds: int
    decode_steps: int
    prefills: int
    max_rows: int
    prefill_s: float = 0.0  # admitting and prefilling (host and GPU)
    decode_s: float = 0.0  # decode steps, up to the host seeing their results
    host_s: float = 0.0  # the rest: stop strings, retiring rows (partly during the next decode), packing


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: PagedKVCache, tokenizer: Tokenizer, *, check_every: int,
                 max_prefill_tokens: int):
        self.runner, self.cache, self.tokenizer = runner, cache, tokenizer
        self.check_every, self.max_prefill_tokens = check_every, max_prefill_tokens
        self.last_stats = CallStats(0, 0, 0, 0)

    def run(self, prompts_ids: list[list[int]], sampling_: Sampling, stop_ids: set[int], seed: int,
            cancelled: Callable[[], bool] | None = None, packed: PackedPrompts | None = None) -> list[Generation]:
        """Generate `sampling_.n` completions per prompt; results are prompt-major (i * n + j).
        `packed`: the same prompts as `validate_prompts` packed them (made here if not given)."""
        n = sampling_.n
        if packed is None:
            packed = pack_prompts(prompts_ids)
        greedy = sampling_.temperature == 0
        mode = StepMode(greedy=greedy, top_k=0 if greedy else sampling_.top_k, top_p=not greedy and sampling_.top_p < 1)
        self.runner.begin(temperature=sampling_.temperature, top_p=sampling_.top_p,
                          max_new_tokens=sampling_.max_new_tokens, stop_ids=stop_ids)
        # The caller's lists as they are (`_admit` copies them once their prefill is queued)
        waiting = deque(_Waiting(i, p, list(range(n))) for i, p in enumerate(packed.as_lists(prompts_ids)))
        rows: list[_Row] = []
        results: list[Generation | None] = [None] * (len(prompts_ids) * n)
        made = []  # tokens made per row, as of the last check
        can_stop = bool(stop_ids or sampling_.stop)
        rounds = steps = prefills = max_rows = 0
        prefill_s = decode_s = host_s = 0.0
        # Host work queued for while the next decode steps run (each says how long it waited for
        # the device): finished rows handed back, outputs so far turned into lists.
        pending: list[Callable[[], float]] = []
        collections = _Collections()  # off until `restore`
        try:
            while waiting or rows:
                if cancelled is not None and cancelled():
                    raise GenerationCancelled("generate: the caller cancelled")
                started = time.perf_counter()
                admitted = self._admit(waiting, rows, seed, sampling_.max_new_tokens, mode, packed)
                admitted_at = time.perf_counter()
                prefill_s += admitted_at - started
                prefills += admitted
                made += [1] * (len(rows) - len(made))
                max_rows = max(max_rows, len(rows))
                todo = self._steps_before_check(made, sampling_.max_new_tokens, can_stop)
                if todo > 0:
                    self.runner.decode(len(rows), todo, mode)
                    steps += todo
                for work in pending:  # while those steps run
                    spent, waited = _timed(work)
                    host_s += spent - waited
                    decode_s += waited
                    admitted_at += spent  # (not the decode's)
                pending = []
                if todo > 0:
                    collections.collect_due()  # while those steps run too
                if can_stop:
                    done, made = self.runner.read(len(rows))
                    stopped = self._stop_strings(rows, made, done, sampling_.stop) if sampling_.stop else {}
                    finished = [k for k in range(len(rows)) if done[k] or k in stopped]
                else:
                    # Nothing but its length limit ends a row, so the host knows which rows these
                    # steps finish without reading anything: their outputs are queued to be copied
                    # out after the steps, and waited for only when they are handed back.
                    stopped, made = {}, [m + todo for m in made]
                    finished = [k for k, m in enumerate(made) if m >= sampling_.max_new_tokens]
                    if not finished:
                        # None finishes: the rows' outputs so far are copied out after these steps
                        # and turned into lists while the next ones run, which waits for this
                        # round only then (the device runs on, and a cancel is still seen within
                        # a round or two), and leaves less to do when the rows finish.
                        if rows:
                            pending.append(self._outputs_so_far(rows, made))
                        rounds += 1
                        decode_s += time.perf_counter() - admitted_at
                        continue
                read_at = time.perf_counter()
                decode_s += read_at - admitted_at
                if finished:
                    pending.append(self._retire(rows, finished, made, stopped, stop_ids, results, n))
                    finished_set = set(finished)
                    keep = [k for k in range(len(rows)) if k not in finished_set]
                    self.runner.keep(keep)
                    rows = [rows[k] for k in keep]
                    made = [made[k] for k in keep]
                rounds += 1
                host_s += time.perf_counter() - read_at
            for work in pending:
                spent, waited = _timed(work)
                host_s += spent - waited
                decode_s += waited
        finally:
            collections.restore()
            for row in rows:  # an error or a cancel mid-call: give every block back
                self.cache.allocator.free(row.blocks)
        self.last_stats = CallStats(rounds, steps, prefills, max_rows, prefill_s, decode_s, host_s)
        return results  # type: ignore[return-value]

    def _steps_before_check(self, made: list[int], max_new: int, can_stop: bool) -> int:
        """Decode steps to run before the host looks again. A row with no stop token or string
        to meet can only finish at its length limit, which the host knows: with none, it looks
        when the first row gets there (at most MAX_UNCHECKED_STEPS on, for a cancel to be seen,
        and that look reads nothing: `run` only waits for the round before), rather than every
        `check_every` steps, each look a sync that leaves the device idle. The round before that
        one stops LAST_ROUND_STEPS short of it."""
        left = [max_new - m for m in made]
        if can_stop:
            return min(self.check_every, max(left, default=0))
        first = min((n for n in left if n > 0), default=0)
        return min(MAX_UNCHECKED_STEPS, first if first <= LAST_ROUND_STEPS else max(1, first - LAST_ROUND_STEPS))

    def _admit(self, waiting: deque, rows: list[_Row], seed: int, max_new: int, mode: StepMode,
               packed: PackedPrompts) -> int:
        """Prefill as many waiting prompts as slots, blocks and the prefill budget allow (their
        ids taken from `packed`)."""
        bs = self.cache.shape.block_size
        allocator = self.cache.allocator
        free = self.runner.capacity - len(rows)
        if rows and waiting and free < min(self.runner.capacity // 4, sum(len(w.samples) for w in waiting)):
            return 0  # a prefill costs a forward however few rows it starts: wait for a quarter of the slots
        # Planned first, then every block taken in one allocation: the same blocks, in the same
        # order, as one allocation a prompt (256 of them cost ~0.3 ms of host time before the prefill).
        indices, plan = [], []
        tokens = taken = reserved = 0
        slots, free_blocks = self.runner.capacity - len(rows), allocator.num_free
        while waiting:
            item = waiting[0]
            length = len(item.prompt_ids)
            count = min(len(item.samples), slots - taken)
            if count == 0 or (indices and tokens + length > self.max_prefill_tokens):
                break
            shared = length // bs  # blocks the prompt fills completely
            per_row = -(-(length + max_new) // bs)
            need = shared + count * (per_row - shared)
            if need > free_blocks - reserved:
                if rows or plan:
                    break  # wait for rows to finish
                if per_row > allocator.num_blocks - 1:
                    raise PromptTooLong(
                        f"prompts_ids: prompt {item.prompt_index} ({length} tokens) plus max_new_tokens={max_new} "
                        f"needs {per_row} KV blocks of {bs} tokens; the cache has {allocator.num_blocks - 1}")
                count = max(1, min(count, (free_blocks - shared) // max(1, per_row - shared)))
                need = shared + count * (per_row - shared)
            indices.append(item.prompt_index)
            # (the prompt, where its blocks start in the allocation: the shared ones, then each sample's own)
            plan.append((item, reserved, item.samples[:count], shared, per_row - shared))
            reserved += need
            tokens += length
            taken += count
            item.samples = item.samples[count:]
            if not item.samples:
                waiting.popleft()
        if not indices:
            return 0
        every = allocator.allocate(reserved)
        tables = []  # each prompt's first sample's: the shared blocks, then its own
        for _, first, samples, shared, own_count in plan:
            for _ in range(len(samples) - 1):
                allocator.share(every[first : first + shared])
            tables.append(every[first : first + shared + own_count])
        # The prefill is queued first and the rows are made while it runs: the host's work per
        # row (a sampling key, the row's records) would otherwise be time the device sits idle.
        logits = self.runner.prefill(packed, indices, tables)
        new, new_rows, copies_src, copies_dst = [], [], [], []
        for group, (item, first, samples, shared, own_count) in enumerate(plan):
            prompt_ids = list(item.prompt_ids)  # the results' own, whatever the caller does with theirs
            blocks = every[first : first + shared + len(samples) * own_count]
            shared_blocks = blocks[:shared]
            partial = len(prompt_ids) % bs
            for i, j in enumerate(samples):
                table = shared_blocks + blocks[shared + i * own_count : shared + (i + 1) * own_count]
                if i > 0 and partial:  # the prompt's last, partly filled block: each sample its own copy
                    copies_src.append(blocks[shared])
                    copies_dst.append(table[shared])
                new.append(_Row(item.prompt_index, j, prompt_ids, table))
                new_rows.append(NewRow(table, len(prompt_ids), sampling.row_key(seed, item.prompt_index, j), group))
        self.runner.start(logits, new_rows, len(rows), mode)
        self.cache.copy_blocks(copies_src, copies_dst)
        rows.extend(new)
        return len(indices)

    def _outputs_so_far(self, rows: list[_Row], made: list[int]) -> Callable[[], float]:
        """Copy the rows' outputs not yet on the host (up to `made`) out after the steps queued so
        far; the returned function appends them to each row's lists, and says how many seconds it
        waited for the copy."""
        copied = self.runner.outputs_async(list(range(len(rows))), made, start=min(len(row.ids) for row in rows))
        taken = list(rows)

        def append() -> float:
            waited = copied.wait()
            copied.append_to([(row.ids, row.logprobs) for row in taken])
            return waited

        return append

    def _stop_strings(self, rows: list[_Row], made: list[int], done: list[bool], stops: tuple[str, ...]) -> dict[int, tuple[int, str]]:
        """Rows whose text now holds a stop string: row -> (tokens to keep, text cut after it).
        Keeps the earliest token that completed a stop string, as a check after every step would."""
        hits: dict[int, tuple[int, str]] = {}
        width = max(made, default=0)
        if width == 0:
            return hits
        outputs = self.runner.tokens_so_far(len(rows), width)
        for k, row in enumerate(rows):
            ids = outputs[k][: made[k]]
            if row.searched >= len(ids) or not any(s in self.tokenizer.decode(ids) for s in stops):
                row.searched = len(ids)
                continue
            for length in range(max(1, row.searched), len(ids) + 1):
                text = self.tokenizer.decode(ids[:length])
                ends = [text.find(s) + len(s) for s in stops if s in text]
                if ends:
                    hits[k] = (length, text[: min(ends)])
                    break
            row.searched = len(ids)
        if hits:
            self.runner.finish([k for k in hits if not done[k]])
        return hits

    def _retire(self, rows: list[_Row], finished: list[int], made: list[int], stopped: dict[int, tuple[int, str]],
                stop_ids: set[int], results: list, n: int) -> Callable[[], float]:
        """Hand rows `finished` back: their outputs copied out (queued on the device before the
        rows are packed over) and their blocks freed now, for this round's admissions; the
        returned function turns the copies into `Generation`s in `results`, to be called while
        the next decode steps run, and says how many seconds of that it waited for the copies."""
        lengths = [stopped[k][0] if k in stopped else made[k] for k in finished]
        done_rows = [rows[k] for k in finished]
        copied = self.runner.outputs_async(finished, lengths, start=min(len(row.ids) for row in done_rows))
        self.cache.allocator.free([b for row in done_rows for b in row.blocks])  # one call, in the order of one a row
        for row in done_rows:
            row.blocks = []
        stops = [stopped.get(k) for k in finished]

        def hand_back() -> float:
            waited = copied.wait()
            outputs = copied.append_to([(row.ids, row.logprobs) for row in done_rows])
            plain = [i for i, stop in enumerate(stops) if stop is None]
            texts = dict(zip(plain, self.tokenizer.decode_batch([outputs[i][0] for i in plain]))) if plain else {}
            for i, (row, (ids, logprobs), stop) in enumerate(zip(done_rows, outputs, stops)):
                if stop is not None:
                    text, reason = stop[1], "stop"
                else:
                    text, reason = texts[i], "stop" if ids and ids[-1] in stop_ids else "length"
                # With n = 1 a row's prompt list is its own (`_admit` copied the caller's) and nothing
                # else keeps it; the n samples of a prompt share theirs, so each result takes a copy.
                prompt_ids = row.prompt_ids if n == 1 else list(row.prompt_ids)
                results[row.prompt_index * n + row.sample_index] = Generation(
                    prompt_index=row.prompt_index, prompt_ids=prompt_ids, output_ids=ids, text=text,
                    logprobs=logprobs, finish_reason=reason)
            return waited

        return hand_back
