"""Continuous batching for every caller: one running batch, requests joining and leaving it.

The scheduler owns the host's view of the batch: the rows in their slots, the requests' prompts
still waiting, and every row's blocks. A request (`Request`: one caller's prompts and sampling
settings) is submitted at any time; each round (`round`) admits waiting prompts of any request
into free slots while their blocks fit (one prefill for a prompt's `n` samples, which share the
blocks the prompt fills; prompts are admitted once a quarter of the slots is free, so prefills
come in batches), lets the runner decode a few steps with no host sync, then reads which rows are
done, looks for stop strings, hands finished rows back to their requests as `Generation`s, frees
their blocks and packs the rest to the front. A request is answered when its last row is done, and
`Request.on_result` sees each row as it finishes. Handing rows back is split in two: their outputs
are copied out and their blocks freed before the rest are packed, and the host work (lists, text,
`Generation`s) is done while the next round's decode steps run, not while the device waits for it.

Rows in one batch share the settings a captured decode step reads (`Request.batch_class`:
temperature, top-p, top-k, max_new_tokens, stop token ids); seeds, `n`, stop strings and
priorities are per request. When requests of another class wait, the running class admits at
most a batch's worth of rows since it was picked, finishes them, and the batch switches; the
next class picked alternates between that of the oldest eval request and that of the oldest
request of any priority, so neither eval nor train, nor any class, starves. Within a class,
`eval` and `train` requests are admitted alternately, a prompt each.

A cancelled request (its `cancelled` polled once a round) leaves at the next round: its waiting
prompts dropped, its rows' blocks freed, the rest of the batch untouched. Weight updates happen
between rounds (`set_version`: every row records from which token on the new version made its
tokens, `Generation.versions`; `abort_running`: the running rows end now, marked "abort", with
their tokens so far; `hold_new`: no request that has not started is admitted, for a drain).

The host's own work is kept off the device's critical path: a prefill is queued before its rows'
records are made; rows that nothing but their length limit can end are never read (the host
knows when they finish), and their outputs so far are turned into lists a round at a time while
later steps run, so that little is left for the end of a row, when the device may be idle.

A row reserves blocks for its prompt plus max_new_tokens when admitted while the pool holds all
that the rows running and waiting may make. When it does not, rows are admitted with blocks for
RESERVE_AHEAD tokens past their prompt (while a free block is left for each row that grows) and
take more as they go (`_grow`); when the pool runs dry the youngest rows are preempted: their
blocks freed, their outputs so far kept, and they wait at the head of their queue to be
prefilled again (prompt and outputs) and go on, with the draws of a row never preempted. A full
pool makes prompts wait; it never refuses them.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from services.models.tokenizer import Tokenizer
from services.rollout.builtin import sampling
from services.rollout.builtin.kv_cache import PagedKVCache
from services.rollout.builtin.prefix_cache import PrefixCache
from services.rollout.builtin.runner import ModelRunner, NewRow, StepMode
from services.rollout.types import Generation, PackedPrompts, Sampling, pack_prompts


MAX_UNCHECKED_STEPS = 64  # decode steps between host checks at most, when rows cannot stop early
# When rows cannot stop early, the round before the first of them finishes ends this many steps
# short of it: their outputs up to there become lists while those last steps run, so that few
# are left to convert when the device is done (`Scheduler._outputs_so_far`).
LAST_ROUND_STEPS = 8
# A row admitted when the pool cannot hold all it may make gets blocks for this many tokens past
# its prompt, and more as it goes; when none are left the youngest rows are preempted.
RESERVE_AHEAD = 64


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


PRIORITIES = ("eval", "train")


@dataclass(eq=False)
class Request:
    """One caller's prompts and settings, and what has come back of them so far.

    `results` are prompt-major (results[i * n + j] is sample j of prompt i); `on_result(index,
    generation)` is called (on the scheduler's thread) as each one finishes, and `on_finish(request)`
    once when it ends (after its last `on_result`; `error` says how it ended). `wait` returns them
    all, or raises what ended the request (GenerationCancelled, PromptTooLong, an engine error)."""

    prompts: list[list[int]]
    packed: PackedPrompts
    sampling: Sampling
    stop_ids: frozenset[int]
    seed: int
    priority: str = "train"
    cancelled: Callable[[], bool] | None = None
    on_result: Callable[[int, Generation], None] | None = None
    on_finish: Callable[["Request"], None] | None = None
    results: list = field(init=False)
    left: int = field(init=False)
    started: bool = field(default=False, init=False)  # a prompt of it has been admitted
    error: BaseException | None = field(default=None, init=False)
    finished: threading.Event = field(default_factory=threading.Event, init=False)
    arrival: int = field(default=0, init=False)
    unadmitted: int = field(default=0, init=False)  # rows not yet in the batch

    def __post_init__(self) -> None:
        if self.priority not in PRIORITIES:
            raise ValueError(f"priority: must be one of {', '.join(PRIORITIES)}, got {self.priority!r}")
        self.results = [None] * (len(self.prompts) * self.sampling.n)
        self.left = self.unadmitted = len(self.results)

    @property
    def longest(self) -> int:
        """Positions its longest row needs."""
        return int(self.packed.lengths.max(initial=0)) + self.sampling.max_new_tokens

    @property
    def batch_class(self) -> tuple:
        """What rows must share to run in one batch: what a captured decode step reads."""
        s = self.sampling
        if s.temperature == 0:
            return (0.0, 1.0, 0, s.max_new_tokens, self.stop_ids)
        return (s.temperature, s.top_p, s.top_k, s.max_new_tokens, self.stop_ids)

    def finish(self, error: BaseException | None = None) -> None:
        if not self.finished.is_set():
            self.error = error
            self.finished.set()
            if self.on_finish is not None:
                self.on_finish(self)

    def wait(self, timeout: float | None = None) -> list[Generation]:
        if not self.finished.wait(timeout):
            raise TimeoutError("generate: still running")
        if self.error is not None:
            raise self.error
        return self.results


@dataclass
class _Row:
    request: Request
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    blocks: list[int]  # the row's references: the prompt's shared blocks, then its own
    searched: int = 0  # output tokens already searched for stop strings
    # Its first outputs, already on the host (`Scheduler._outputs_so_far`); handing the row back
    # appends the rest and gives these lists to its `Generation`.
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    runs: list[tuple[int, int]] = field(default_factory=list)  # (weight version, from output token)
    final_blocks: int = 0  # what prompt plus max_new_tokens needs: len(blocks) < final_blocks grows
    prompt_keys: list[bytes] = field(default_factory=list)  # its prompt's prefix-cache keys, if looked up


@dataclass
class _Waiting:
    request: Request
    prompt_index: int
    prompt_ids: list[int]
    samples: list[int]  # sample indices not yet admitted
    keys: tuple[int, list[bytes]] | None = None  # (weight version, prefix-cache keys of its full blocks)
    resume: _Row | None = None  # a preempted row: prompt_ids is its prompt and outputs so far


@dataclass(frozen=True)
class CallStats:
    """Of the last busy period (from the first request admitted to the scheduler going idle)."""

    rounds: int
    decode_steps: int
    prefills: int
    max_rows: int
    prefill_s: float = 0.0  # admitting and prefilling (host and GPU)
    decode_s: float = 0.0  # decode steps, up to the host seeing their results
    host_s: float = 0.0  # the rest: stop strings, retiring rows (partly during the next decode), packing
    preempted: int = 0  # rows taken out of the batch for blocks, recomputed later


@dataclass
class _Counters:
    rounds: int = 0
    decode_steps: int = 0
    prefills: int = 0
    max_rows: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    host_s: float = 0.0
    preempted: int = 0

    def frozen(self) -> CallStats:
        return CallStats(self.rounds, self.decode_steps, self.prefills, self.max_rows, self.prefill_s,
                         self.decode_s, self.host_s, self.preempted)


def versions_of(runs: list[tuple[int, int]], length: int) -> tuple[tuple[int, int], ...]:
    """(version, tokens) runs of a row's `length` outputs from its (version, from token) marks."""
    out: list[tuple[int, int]] = []
    for (version, start), (_, end) in zip(runs, [*runs[1:], (None, length)]):
        count = min(end, length) - min(start, length)
        if count <= 0:
            continue
        if out and out[-1][0] == version:
            out[-1] = (version, out[-1][1] + count)
        else:
            out.append((version, count))
    return tuple(out)


class Scheduler:
    def __init__(self, runner: ModelRunner, cache: PagedKVCache, tokenizer: Tokenizer, *, check_every: int,
                 max_prefill_tokens: int, version: int = 0, prefix_cache: bool = False):
        self.runner, self.cache, self.tokenizer = runner, cache, tokenizer
        self.prefix = PrefixCache(cache.allocator, cache.shape.block_size, version) if prefix_cache else None
        self.check_every, self.max_prefill_tokens = check_every, max_prefill_tokens
        self.last_stats = CallStats(0, 0, 0, 0)
        self.version = version  # of the weights the next decode steps run with
        self.hold_new = False  # admit only requests already started (an update draining them)
        self._queues: dict[str, deque[_Waiting]] = {p: deque() for p in PRIORITIES}
        self._waiting_rows = 0
        self._live: list[Request] = []  # submitted and not finished, oldest first
        self._rows: list[_Row] = []
        self._made: list[int] = []  # tokens made per row, as of the last check
        # Host work queued for while the next decode steps run (each says how long it waited for
        # the device): finished rows handed back, outputs so far turned into lists.
        self._pending: list[Callable[[], float]] = []
        self._class: tuple | None = None
        self._mode: StepMode | None = None
        self._arrivals = itertools.count()
        self._submitted = self._submitted_seen = 0  # requests submitted: in all, as of the last round
        self._turn = 0  # eval or train admitted next (`_next_waiting`)
        self._picks = 0  # classes picked so far (`_pick_class`)
        self._epoch_rows = 0  # rows the running class admitted since it was picked
        self._counters = _Counters()
        self._collections: _Collections | None = None
        # Over the scheduler's life (what `RolloutEngine.load` reports):
        self.rounds_run = 0
        self.steps_run = 0  # decode steps
        self.row_steps = 0  # rows in the batch, summed over decode steps (over steps_run: rows a step)
        self.prefills_run = 0  # prefill forwards (each admits one or more prompts)
        self._spent = [0.0, 0.0, 0.0]  # prefill, decode and host seconds of busy periods that ended
        self.peak_rows = 0  # the most rows in the batch at once, over its life
        self._held: dict[int, list[int]] = {}  # finished rows' blocks kept until their outputs are cached
        self.preempted = 0  # rows preempted, over its life

    # ---- what callers see -------------------------------------------------------------------

    def submit(self, request: Request) -> Request:
        request.arrival = next(self._arrivals)
        if not request.prompts:
            request.finish()
            return request
        queue = self._queues[request.priority]
        for i, prompt in enumerate(request.prompts):
            queue.append(_Waiting(request, i, prompt, list(range(request.sampling.n))))
        self._waiting_rows += len(request.results)
        self._submitted += 1
        self._live.append(request)
        return request

    def run(self, prompts_ids: list[list[int]], sampling_: Sampling, stop_ids: set[int], seed: int,
            cancelled: Callable[[], bool] | None = None, packed: PackedPrompts | None = None) -> list[Generation]:
        """One call served here, round by round, until it is done (no other caller's thread):
        `sampling_.n` completions per prompt, prompt-major (i * n + j). `packed`: the same
        prompts as `validate_prompts` packed them (made here if not given)."""
        packed = packed if packed is not None else pack_prompts(prompts_ids)
        request = self.submit(Request(packed.as_lists(prompts_ids), packed, sampling_, frozenset(stop_ids), seed,
                                      cancelled=cancelled))
        while not request.finished.is_set():
            self.round()
        return request.wait()

    @property
    def busy(self) -> bool:
        return bool(self._rows or self._pending or self._waiting_rows)

    @property
    def running(self) -> bool:
        """Rows are in the batch, or their results still on the way to their requests."""
        return bool(self._rows or self._pending)

    @property
    def rows_running(self) -> int:
        return len(self._rows)

    @property
    def rows_waiting(self) -> int:
        return self._waiting_rows

    def live(self) -> list[Request]:
        return list(self._live)

    def started(self) -> list[Request]:
        """Requests with a row admitted that are not finished (what a drain waits for)."""
        return [r for r in self._live if r.started]

    # ---- between rounds ---------------------------------------------------------------------

    def attach(self, runner: ModelRunner, cache: PagedKVCache) -> None:
        """A new pool and runner (only while no row runs)."""
        assert not self.running, "attach: rows are running"
        self.runner, self.cache = runner, cache
        self._class = None
        if self.prefix is not None:  # a new pool: nothing of the old one is cached
            self.prefix = PrefixCache(cache.allocator, cache.shape.block_size, self.version)

    def set_version(self, version: int) -> None:
        """The weights changed between rounds: the running rows' next tokens come from `version`."""
        for row, made in zip(self._rows, self._made):
            row.runs.append((version, made))
        self.version = version
        if self.prefix is not None:  # no KV of the old weights is ever matched again
            self.prefix.clear(version)

    def abort_running(self) -> int:
        """End every running row now, finish_reason "abort", with its tokens so far (a request
        whose prompts still wait goes on with those). Returns the rows ended."""
        count = len(self._rows)
        if count:
            self._pending.append(self._retire(list(range(count)), list(self._made), {}, reason="abort"))
            self._rows, self._made = [], []
            self.runner.keep([])
        self._flush()
        for queue in self._queues.values():  # rows preempted mid-way are running rows too
            for item in [w for w in queue if w.resume is not None]:
                queue.remove(item)
                self._waiting_rows -= 1
                item.request.unadmitted -= 1
                self._hand_back_preempted(item.resume, "abort")
                count += 1
        return count

    def _hand_back_preempted(self, row: _Row, reason: str) -> None:
        request = row.request
        if request.finished.is_set():
            return
        self._deliver(row, Generation(
            prompt_index=row.prompt_index, prompt_ids=list(row.prompt_ids), output_ids=row.ids,
            text=self.tokenizer.decode(row.ids), logprobs=row.logprobs, finish_reason=reason,
            versions=versions_of(row.runs, len(row.ids))))

    def _deliver(self, row: _Row, result: Generation) -> None:
        """A row's completion to its request (`on_result`), which is answered with its last."""
        request = row.request
        index = row.prompt_index * request.sampling.n + row.sample_index
        request.results[index] = result
        if request.on_result is not None:
            request.on_result(index, result)
        request.left -= 1
        if request.left == 0:
            self._live.remove(request)
            request.finish()

    def fail(self, error: BaseException, requests: list[Request] | None = None) -> None:
        """End `requests` (default: every live one) with `error`: their rows' blocks freed, their
        waiting prompts dropped."""
        targets = set(map(id, self._live if requests is None else requests))
        dropped = [r for r in self._live if id(r) in targets]
        for queue in self._queues.values():
            kept = [w for w in queue if id(w.request) not in targets]
            self._waiting_rows -= sum(len(w.samples) for w in queue) - sum(len(w.samples) for w in kept)
            queue.clear()
            queue.extend(kept)
        keep = [k for k, row in enumerate(self._rows) if id(row.request) not in targets]
        if len(keep) != len(self._rows):
            self.cache.allocator.free([b for row in self._rows if id(row.request) in targets for b in row.blocks])
            self.runner.keep(keep)
            self._rows = [self._rows[k] for k in keep]
            self._made = [self._made[k] for k in keep]
        for request in dropped:
            request.finish(error)
        self._live = [r for r in self._live if id(r) not in targets]
        if not self.busy:
            self._idle()

    # ---- a round ----------------------------------------------------------------------------

    def round(self) -> None:
        """Admit, decode a few steps, hand back what finished. An error fails every live request
        (their blocks given back) and is raised."""
        if self._collections is None:
            self._collections = _Collections()  # off until the scheduler is idle
            self._counters = _Counters()
        self.rounds_run += 1
        try:
            self._round()
        except BaseException as e:
            self._pending = []
            self._release_held()
            self.fail(e)
            raise
        if not self.busy:
            self._idle()

    def seconds_spent(self) -> tuple[float, float, float]:
        """Prefill, decode and host seconds over the scheduler's life (see CallStats)."""
        c = self._counters
        return (self._spent[0] + c.prefill_s, self._spent[1] + c.decode_s, self._spent[2] + c.host_s)

    def _idle(self) -> None:
        self._flush()
        c = self._counters
        self._spent = [self._spent[0] + c.prefill_s, self._spent[1] + c.decode_s, self._spent[2] + c.host_s]
        if self._collections is not None:
            self._collections.restore()
            self._collections = None
        self.last_stats = self._counters.frozen()
        self._counters = _Counters()  # (counted in _spent now)

    def _flush(self) -> None:
        c = self._counters
        for work in self._pending:
            spent, waited = _timed(work)
            c.host_s += spent - waited
            c.decode_s += waited
        self._pending = []

    def _round(self) -> None:
        c = self._counters
        for request in list(self._live):
            if request.cancelled is not None and request.cancelled():
                self.fail(GenerationCancelled("generate: the caller cancelled"), [request])
        started = time.perf_counter()
        # Requests that arrived while rows ran (not a call starting the batch): more are likely on
        # the way (`_steps_before_check`).
        arriving = bool(self._rows) and self._submitted != self._submitted_seen
        self._submitted_seen = self._submitted
        if not self._rows:
            self._flush()  # (their rows are gone: nothing to overlap)
            self._pick_class()
        admitted = self._admit() if self._class is not None else 0
        rows = self._rows
        if not rows:
            self._flush()
            return
        admitted_at = time.perf_counter()
        c.prefill_s += admitted_at - started
        c.prefills += admitted
        if admitted:
            self.prefills_run += 1
        self._made += [len(row.ids) + 1 for row in rows[len(self._made):]]  # (a resumed row: its outputs too)
        made = self._made
        c.max_rows = max(c.max_rows, len(rows))
        self.peak_rows = max(self.peak_rows, len(rows))
        max_new = self._class[3]
        can_stop = bool(self._class[4]) or any(row.request.sampling.stop for row in rows)
        # With room in the batch, arrivals join at a round's end: short rounds while they come,
        # rather than on to the first finish, which kept them waiting tens of steps.
        arriving = arriving and len(rows) < self.runner.capacity
        todo = self._steps_before_check(made, max_new, can_stop, arriving)
        if any(row.final_blocks > len(row.blocks) for row in rows):  # rows that grow as they go
            todo = min(todo, self.cache.shape.block_size)
            self._grow(todo)
            rows, made = self._rows, self._made
            todo = min(todo, self._steps_before_check(made, max_new, can_stop, arriving))
        if todo > 0:
            self.runner.decode(len(rows), todo, self._mode)
            c.decode_steps += todo
            self.steps_run += todo
            self.row_steps += todo * len(rows)
        for work in self._pending:  # while those steps run
            spent, waited = _timed(work)
            c.host_s += spent - waited
            c.decode_s += waited
            admitted_at += spent  # (not the decode's)
        self._pending = []
        if todo > 0:
            self._collections.collect_due()  # while those steps run too
        if can_stop:
            done, made = self.runner.read(len(rows))
            stopped = self._stop_strings(rows, made, done)
            finished = [k for k in range(len(rows)) if done[k] or k in stopped]
        else:
            # Nothing but its length limit ends a row, so the host knows which rows these steps
            # finish without reading anything: their outputs are queued to be copied out after
            # the steps, and waited for only when they are handed back.
            stopped, made = {}, [min(m + todo, max_new) for m in made]
            finished = [k for k, m in enumerate(made) if m >= max_new]
            if not finished:
                # None finishes: the rows' outputs so far are copied out after these steps and
                # turned into lists while the next ones run, which waits for this round only then
                # (the device runs on, and a cancel is still seen within a round or two), and
                # leaves less to do when the rows finish.
                self._pending.append(self._outputs_so_far(rows, made))
                self._made = made
                c.rounds += 1
                c.decode_s += time.perf_counter() - admitted_at
                return
        read_at = time.perf_counter()
        c.decode_s += read_at - admitted_at
        if finished:
            self._pending.append(self._retire(finished, made, stopped))
            finished_set = set(finished)
            keep = [k for k in range(len(rows)) if k not in finished_set]
            self.runner.keep(keep)
            self._rows = [rows[k] for k in keep]
            made = [made[k] for k in keep]
        self._made = made
        c.rounds += 1
        c.host_s += time.perf_counter() - read_at

    def _pick_class(self) -> None:
        """With no row running: the class that runs next. Picks alternate between the class of
        the oldest waiting eval request and that of the oldest waiting request of any priority."""
        candidates = [r for r in self._live if r.unadmitted > 0 and (r.started or not self.hold_new)]
        if not candidates:
            return
        evals = [r for r in candidates if r.priority == "eval"]
        prefer_eval = self._picks % 2 == 0 and evals
        self._picks += 1
        wanted = min(evals if prefer_eval else candidates, key=lambda r: r.arrival).batch_class
        self._epoch_rows = 0
        if wanted == self._class:
            return
        temperature, top_p, top_k, max_new, stop_ids = wanted
        greedy = temperature == 0
        self._class = wanted
        self._mode = StepMode(greedy=greedy, top_k=top_k, top_p=not greedy and top_p < 1)
        self.runner.begin(temperature=temperature, top_p=top_p, max_new_tokens=max_new, stop_ids=set(stop_ids))

    def _budget(self) -> float:
        """Rows the running class may still admit: once another class waits, a batch's worth
        (`capacity` rows since the class was picked), then its rows finish and the batch switches."""
        others = any(r.unadmitted > 0 and r.batch_class != self._class and (r.started or not self.hold_new)
                     for r in self._live)
        return self.runner.capacity - self._epoch_rows if others else float("inf")

    def _next_waiting(self) -> deque | None:
        """The queue whose head is admitted next: eval and train in turn, a prompt each."""
        order = PRIORITIES if self._turn % 2 == 0 else PRIORITIES[::-1]
        for priority in order:
            queue = self._queues[priority]
            if queue:
                request = queue[0].request
                if (request.started or not self.hold_new) and request.batch_class == self._class:
                    return queue
        return None

    def _steps_before_check(self, made: list[int], max_new: int, can_stop: bool, arriving: bool = False) -> int:
        """Decode steps to run before the host looks again. A row with no stop token or string
        to meet can only finish at its length limit, which the host knows: with none, it looks
        when the first row gets there (at most MAX_UNCHECKED_STEPS on, for a cancel to be seen,
        and that look reads nothing: `run` only waits for the round before), rather than every
        `check_every` steps, each look a sync that leaves the device idle. The round before that
        one stops LAST_ROUND_STEPS short of it. Rows that arrived at different times finish at
        different steps: a round is still at least `check_every` steps (those that finish early
        sit done in their slots until it ends), or rounds of a step or two, each with a host look
        and a prefill, would leave the device idle most of the time. While requests are
        `arriving` and the batch has room, a round is `check_every` steps: the look reads nothing
        unless a row finishes, and the arrivals join sooner."""
        left = [max_new - m for m in made]
        longest = max(left, default=0)
        if can_stop:
            return min(self.check_every, longest)
        first = min((n for n in left if n > 0), default=0)
        steps = first if first <= LAST_ROUND_STEPS else max(1, first - LAST_ROUND_STEPS)
        return min(self.check_every if arriving else MAX_UNCHECKED_STEPS, max(steps, min(self.check_every, longest)))

    def _admit(self) -> int:
        """Prefill as many waiting prompts as slots, blocks and the prefill budget allow."""
        bs = self.cache.shape.block_size
        allocator = self.cache.allocator
        rows = self._rows
        max_new = self._class[3]
        free = self.runner.capacity - len(rows)
        if rows and self._waiting_rows and free < min(self.runner.capacity // 4, self._waiting_rows):
            return 0  # a prefill costs a forward however few rows it starts: wait for a quarter of the slots
        # Planned first, then every block taken in one allocation: the same blocks, in the same
        # order, as one allocation a prompt (256 of them cost ~0.3 ms of host time before the prefill).
        plan = []
        tokens = taken = reserved = 0
        slots, free_blocks = self.runner.capacity - len(rows), allocator.num_free
        slots = int(min(slots, max(0, self._budget())))
        tight = self._tight(slots, free_blocks)
        growing = sum(1 for row in rows if row.final_blocks > len(row.blocks))  # rows that need a block soon
        while True:
            queue = self._next_waiting()
            if queue is None:
                break
            item = queue[0]
            length = len(item.prompt_ids)
            count = min(len(item.samples), slots - taken)
            if count == 0:
                break
            hit = self._cached_prefix(item)  # blocks held already, this plan's references taken
            computed = length - len(hit) * bs  # the prefill's tokens (a cached prefix is not computed)
            if plan and tokens + computed > self.max_prefill_tokens:
                allocator.free(hit)
                break
            shared = length // bs  # blocks the prompt fills completely
            final = len(item.resume.prompt_ids) + max_new if item.resume is not None else length + max_new
            per_row = final_blocks = -(-final // bs)
            need = shared - len(hit) + count * (per_row - shared)
            if need > free_blocks - reserved and self._held:
                self._flush()  # finished rows' kept blocks: to the cache, where they can be evicted
                free_blocks = allocator.num_free
            if need > free_blocks - reserved and self.prefix is not None:
                free_blocks += self.prefix.evict(need - (free_blocks - reserved))
            if (tight or need > free_blocks - reserved) and (rows or plan or tight):
                # Not room for all the rows may make: admitted with blocks for RESERVE_AHEAD tokens
                # past its prompt while a block a row is left over, to grow as it goes (`_grow`).
                per_row = -(-min(final, length + RESERVE_AHEAD) // bs)
                need = shared - len(hit) + count * (per_row - shared)
                will_grow = count if per_row < final_blocks else 0
                if need + growing + will_grow <= free_blocks - reserved:
                    growing += will_grow
                elif rows or plan:
                    allocator.free(hit)
                    break  # wait for rows to finish
                else:  # nothing runs: all it may make, for as many samples as fit (below)
                    per_row = final_blocks
                    need = shared - len(hit) + count * (per_row - shared)
            if need > free_blocks - reserved:
                if per_row > allocator.num_blocks - 1:
                    allocator.free(hit)
                    self.fail(PromptTooLong(
                        f"prompts_ids: prompt {item.prompt_index} ({length} tokens) plus max_new_tokens={max_new} "
                        f"needs {per_row} KV blocks of {bs} tokens; the cache has {allocator.num_blocks - 1}"),
                        [item.request])
                    continue
                if self.prefix is not None:  # nothing runs: every cached block but its own may go
                    free_blocks += self.prefix.evict(len(self.prefix))
                count = max(1, min(count, (free_blocks - shared + len(hit)) // max(1, per_row - shared)))
                need = shared - len(hit) + count * (per_row - shared)
            if self.prefix is not None:
                self.prefix.record(length, len(hit))
            # (the prompt, where its blocks start in the allocation: the shared ones not cached, then
            # each sample's own; the cached blocks it starts with)
            plan.append((item, reserved, item.samples[:count], shared - len(hit), per_row - shared, hit, final_blocks))
            item.request.started = True
            reserved += need
            tokens += computed
            taken += count
            self._waiting_rows -= count
            self._epoch_rows += count
            item.request.unadmitted -= count
            self._turn += 1
            item.samples = item.samples[count:]
            if not item.samples:
                queue.popleft()
        if not plan:
            return 0
        every = allocator.allocate(reserved)
        tables = []  # each prompt's first sample's: the shared blocks, then its own
        for _, first, samples, shared, own_count, hit, _ in plan:
            for _ in range(len(samples) - 1):
                allocator.share(hit + every[first : first + shared])
            tables.append(hit + every[first : first + shared + own_count])
        # The prefill is queued first and the rows are made while it runs: the host's work per
        # row (a sampling key, the row's records) would otherwise be time the device sits idle.
        first_request = plan[0][0].request
        if all(item.request is first_request and item.resume is None for item, *_ in plan):  # one caller's: its packed ids
            packed, indices = first_request.packed, [item.prompt_index for item, *_ in plan]
        else:
            packed, indices = pack_prompts([item.prompt_ids for item, *_ in plan]), list(range(len(plan)))
        logits = self.runner.prefill(packed, indices, tables, [len(plan_item[5]) * bs for plan_item in plan])
        new, new_rows, copies_src, copies_dst = [], [], [], []
        for group, (item, first, samples, shared, own_count, hit, final_blocks) in enumerate(plan):
            prompt_ids = list(item.prompt_ids)  # the results' own, whatever the caller does with theirs
            blocks = hit + every[first : first + shared + len(samples) * own_count]
            shared = len(hit) + shared
            shared_blocks = blocks[:shared]
            if self.prefix is not None:  # its full blocks, for later prompts (their KV is queued)
                self.prefix.insert(item.keys[1][len(hit):shared], shared_blocks[len(hit):])
            partial = len(prompt_ids) % bs
            request = item.request
            if item.resume is not None:  # a preempted row back, its KV recomputed: it goes on where it was
                row = item.resume
                row.blocks, row.final_blocks = blocks, final_blocks
                if row.runs[-1][0] != self.version:  # (weights changed while it waited)
                    row.runs.append((self.version, len(row.ids)))
                new.append(row)
                new_rows.append(NewRow(blocks, len(prompt_ids), sampling.row_key(request.seed, row.prompt_index,
                                                                                 row.sample_index), group,
                                       outputs=(row.ids, row.logprobs)))
                continue
            for i, j in enumerate(samples):
                table = shared_blocks + blocks[shared + i * own_count : shared + (i + 1) * own_count]
                if i > 0 and partial:  # the prompt's last, partly filled block: each sample its own copy
                    copies_src.append(blocks[shared])
                    copies_dst.append(table[shared])
                new.append(_Row(request, item.prompt_index, j, prompt_ids, table, runs=[(self.version, 0)],
                                final_blocks=final_blocks,
                                prompt_keys=item.keys[1] if item.keys and item.keys[0] == self.version else []))
                new_rows.append(NewRow(table, len(prompt_ids), sampling.row_key(request.seed, item.prompt_index, j),
                                       group))
        self.runner.start(logits, new_rows, len(rows), self._mode)
        self.cache.copy_blocks(copies_src, copies_dst)
        rows.extend(new)
        return len(plan)

    def _tight(self, slots: int, free_blocks: int) -> bool:
        """Whether the pool is short of what the rows running and the next `slots` rows waiting
        may make (then rows are admitted with part of it, `_admit`)."""
        bs = self.cache.shape.block_size
        max_new = self._class[3]
        short = sum(row.final_blocks - len(row.blocks) for row in self._rows)
        for queue in self._queues.values():
            for item in itertools.islice(queue, slots):
                if item.request.batch_class == self._class:
                    prompt = len(item.resume.prompt_ids) if item.resume is not None else len(item.prompt_ids)
                    short += len(item.samples) * -(-(prompt + max_new) // bs)
        room = free_blocks + sum(len(blocks) for blocks in self._held.values())
        # (counting the evictable blocks walks the whole cache: only when the rest is short)
        return short > room and (self.prefix is None or short > room + self.prefix.evictable())

    def _cache_outputs(self, rows: list[_Row], outputs, held: dict[int, list[int]]) -> None:
        """Cache the full blocks of held rows' prompts and outputs (the last output's keys and
        values are never written: it was sampled, not fed), then give the rows' blocks back."""
        bs = self.cache.shape.block_size
        for row, (ids, _) in zip(rows, outputs):
            blocks = held.pop(id(row), None)
            if blocks is None:
                continue
            self._held.pop(id(row), None)
            if self.prefix is not None and self.prefix.version == self.version == row.runs[0][0]:
                tokens = row.prompt_ids + ids
                count = min(len(blocks), (len(tokens) - 1) // bs)
                self.prefix.insert(self.prefix.keys(tokens, count, known=row.prompt_keys), blocks[:count])
            self.cache.allocator.free(blocks)

    def _release_held(self) -> None:
        """Blocks kept for the cache by hand-backs that will not run (an error ended them)."""
        for blocks in self._held.values():
            self.cache.allocator.free(blocks)
        self._held.clear()

    def _grow(self, steps: int) -> None:
        """Blocks for the next `steps` tokens of every row admitted short of what it may make;
        where the pool has too few (cached prefixes evicted first), the youngest rows are
        preempted: their blocks freed, their outputs so far kept, and they wait at the head of
        their queue to be prefilled again (prompt and outputs) and go on."""
        bs = self.cache.shape.block_size
        allocator = self.cache.allocator
        rows, made = self._rows, self._made

        def wanted() -> list[tuple[int, int]]:
            out = []
            for k, row in enumerate(rows):
                if row.final_blocks > len(row.blocks):
                    # positions up to prompt + made + steps hold keys and values by then
                    more = min(row.final_blocks, -(-(len(row.prompt_ids) + made[k] + steps) // bs)) - len(row.blocks)
                    if more > 0:
                        out.append((k, more))
            return out

        want = wanted()
        total = sum(n for _, n in want)
        if total > allocator.num_free and self._held:
            self._flush()  # finished rows' kept blocks: to the cache, where they can be evicted
        if total > allocator.num_free and self.prefix is not None:
            self.prefix.evict(total - allocator.num_free)
        while total > allocator.num_free and len(rows) > 1:
            self._preempt(len(rows) - 1)
            want = wanted()
            total = sum(n for _, n in want)
        if not want:
            return
        blocks = allocator.allocate(total)
        entries, at = [], 0
        for k, n in want:
            row = rows[k]
            entries += [(k, len(row.blocks) + i, b) for i, b in enumerate(blocks[at : at + n])]
            row.blocks = row.blocks + blocks[at : at + n]
            at += n
        self.runner.extend_tables(entries)

    def _preempt(self, k: int) -> None:
        """Take row k (the last: the youngest) out of the batch to be recomputed later."""
        rows, made = self._rows, self._made
        row = rows[k]
        self._flush()  # (outputs already queued for it land first)
        self.runner.outputs_async([k], [made[k]], start=len(row.ids)).append_to([(row.ids, row.logprobs)])
        self.cache.allocator.free(row.blocks)
        row.blocks = []
        keep = [i for i in range(len(rows)) if i != k]
        self.runner.keep(keep)
        rows[:] = [rows[i] for i in keep]
        made[:] = [made[i] for i in keep]
        request = row.request
        self._queues[request.priority].appendleft(
            _Waiting(request, row.prompt_index, row.prompt_ids + row.ids, [row.sample_index], resume=row))
        request.unadmitted += 1
        self._waiting_rows += 1
        self._counters.preempted += 1
        self.preempted += 1

    def _cached_prefix(self, item: _Waiting) -> list[int]:
        """The cached blocks a waiting prompt starts with, one reference taken to each (never
        all of the prompt: its last token is prefilled, for its logits)."""
        if self.prefix is None:
            return []
        if self.prefix.allocator is not self.cache.allocator:  # the pool was made again
            self.prefix = PrefixCache(self.cache.allocator, self.cache.shape.block_size, self.version)
        if item.keys is None or item.keys[0] != self.version:
            item.keys = (self.version, self.prefix.keys(item.prompt_ids))
        keys = item.keys[1]
        usable = (len(item.prompt_ids) - 1) // self.cache.shape.block_size
        hit = self.prefix.match(keys[:usable])
        self.cache.allocator.share(hit)
        return hit

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

    def _stop_strings(self, rows: list[_Row], made: list[int], done: list[bool]) -> dict[int, tuple[int, str]]:
        """Rows whose text now holds one of their request's stop strings: row -> (tokens to keep,
        text cut after it). Keeps the earliest token that completed a stop string, as a check
        after every step would."""
        hits: dict[int, tuple[int, str]] = {}
        searching = [k for k, row in enumerate(rows) if row.request.sampling.stop]
        width = max((made[k] for k in searching), default=0)
        if width == 0:
            return hits
        outputs = self.runner.tokens_so_far(len(rows), width)
        for k in searching:
            row, stops = rows[k], rows[k].request.sampling.stop
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

    def _retire(self, finished: list[int], made: list[int], stopped: dict[int, tuple[int, str]],
                reason: str | None = None) -> Callable[[], float]:
        """Hand rows `finished` back: their outputs copied out (queued on the device before the
        rows are packed over) and their blocks freed now, for this round's admissions; the
        returned function turns the copies into `Generation`s of their requests, to be called
        while the next decode steps run, and says how many seconds of that it waited for the
        copies. `reason` overrides the finish reason (an abort)."""
        rows = self._rows
        stop_ids = self._class[4]
        lengths = [stopped[k][0] if k in stopped else made[k] for k in finished]
        done_rows = [rows[k] for k in finished]
        copied = self.runner.outputs_async(finished, lengths, start=min(len(row.ids) for row in done_rows))
        # With the prefix cache, rows made under today's weights keep their blocks until their
        # outputs are on the host: then the blocks their prompt and outputs fill go to the cache
        # (a next turn's history starts with them). The rest are freed now.
        keep = [self.prefix is not None and row.runs == [(self.version, 0)] for row in done_rows]
        self.cache.allocator.free([b for row, kept in zip(done_rows, keep) if not kept for b in row.blocks])
        held = {id(row): row.blocks for row, kept in zip(done_rows, keep) if kept}
        self._held.update(held)
        for row in done_rows:
            row.blocks = []
        stops = [stopped.get(k) for k in finished]
        versions = [versions_of(row.runs, length) for row, length in zip(done_rows, lengths)]

        def hand_back() -> float:
            waited = copied.wait()
            outputs = copied.append_to([(row.ids, row.logprobs) for row in done_rows])
            if held:
                self._cache_outputs(done_rows, outputs, held)
            plain = [i for i, stop in enumerate(stops) if stop is None]
            texts = dict(zip(plain, self.tokenizer.decode_batch([outputs[i][0] for i in plain]))) if plain else {}
            for i, (row, (ids, logprobs), stop) in enumerate(zip(done_rows, outputs, stops)):
                request = row.request
                if request.finished.is_set():  # cancelled or failed meanwhile
                    continue
                if stop is not None:
                    text, why = stop[1], "stop"
                else:
                    text, why = texts[i], "stop" if ids and ids[-1] in stop_ids else "length"
                # With n = 1 a row's prompt list is its own (`_admit` copied the caller's) and nothing
                # else keeps it; the n samples of a prompt share theirs, so each result takes a copy.
                prompt_ids = row.prompt_ids if request.sampling.n == 1 else list(row.prompt_ids)
                self._deliver(row, Generation(
                    prompt_index=row.prompt_index, prompt_ids=prompt_ids, output_ids=ids, text=text,
                    logprobs=logprobs, finish_reason=reason or why, versions=versions[i]))
            return waited

        return hand_back
