"""Asynchronous RL: a producer that keeps the engines generating the coming steps' samples while
the consumer (the job's own thread) trains on finished ones, with bounded staleness.

Generation for step s starts only once step s - 1 - max_staleness is trained and its weights
synced, so every token of step s's samples comes from a version at most max_staleness behind the
weights that train on them; the producer is then at most max_staleness + 1 steps ahead and the
buffer between the two holds at most that many steps. Each sample's staleness is checked again
when it is trained (an engine that served an older version than the gate assumed, say): groups
whose oldest token is further behind are dropped and counted, never trained on.

The producer draws the data batches and sampling seeds in step order, as the synchronous loop
does; the consumer trains steps in order. docs/async.md explains the modes and the metrics.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from services.coordinator.clients import Completion
from services.coordinator.datasets import Example


@dataclass
class Rollout:
    """One step's samples as generated: each example's `samples_per_prompt` completions, in order."""

    step: int
    examples: list[Example]
    prompts: list[str]
    completions: list[Completion]
    generate_s: float
    version: int  # the weights' version when generation began (its tokens are from it or later)
    rewards: list[float] = field(default_factory=list)  # one per completion
    metrics: dict[str, float] = field(default_factory=dict)  # of its making (dynamic sampling)
    reward_s: float = 0.0  # scoring its completions (on the producer's thread when asynchronous)


def oldest_version(completion: Completion) -> int:
    """The oldest weight version any of the completion's tokens came from."""
    return min((version for version, _ in completion.versions), default=completion.weight_version)


def fresh_groups(rollout: Rollout, group_size: int, version: int, max_staleness: int) -> tuple[Rollout, list[int]]:
    """`rollout` less the groups (a prompt's samples) with a token more than `max_staleness`
    versions behind `version`, and the staleness of each sample kept."""
    keep, ages = [], []
    for g, example in enumerate(rollout.examples):
        group = rollout.completions[g * group_size : (g + 1) * group_size]
        group_ages = [version - oldest_version(c) for c in group]
        if max(group_ages, default=0) <= max_staleness:
            keep.append(g)
            ages += group_ages
    if len(keep) == len(rollout.examples):
        return rollout, ages
    return select_groups(rollout, keep, group_size), ages


def select_groups(rollout: Rollout, groups: list[int], group_size: int) -> Rollout:
    """`rollout` with only the groups (prompts and their samples) at indices `groups`."""
    def samples(items: list) -> list:
        return [x for g in groups for x in items[g * group_size : (g + 1) * group_size]]

    return replace(rollout, examples=[rollout.examples[g] for g in groups], prompts=[rollout.prompts[g] for g in groups],
                   completions=samples(rollout.completions), rewards=samples(rollout.rewards) if rollout.rewards else [])


class _Stopped(Exception):
    pass


class AsyncSteps:
    """Iterate `(step, metrics)` over steps first..last: each step's samples generated ahead by a
    producer thread (`produce(step)`), trained on here (`learn(rollout, extra_metrics)`), at most
    `max_staleness` versions old (`version()`: the trainer's version now). `close` stops the
    producer; `check_cancelled()` (which raises to cancel) is polled while waiting for samples."""

    def __init__(self, *, first: int, last: int, max_staleness: int, group_size: int,
                 produce: Callable[[int], Rollout], learn: Callable[[Rollout, dict], dict],
                 version: Callable[[], int], check_cancelled: Callable[[], None], on_drop: Callable[[int, int], None]):
        self.first, self.last, self.max_staleness, self.group_size = first, last, max_staleness, group_size
        self._produce, self._learn, self._version, self._check_cancelled = produce, learn, version, check_cancelled
        self._on_drop = on_drop
        self._ready: queue.Queue = queue.Queue()
        self._gate = threading.Condition()
        self._trained = first - 1  # the last step trained and synced
        self._stopped = False
        self._gated_s = 0.0  # time the producer waited at the gate (the engines had nothing to do)
        self.dropped = 0
        self._thread = threading.Thread(target=self._run_producer, name="rollout-producer", daemon=True)
        self._thread.start()

    # ---- the producer -------------------------------------------------------------------------
    def _run_producer(self) -> None:
        try:
            for step in range(self.first, self.last + 1):
                self._wait_at_gate(step)
                self._ready.put(self._produce(step))
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, which raises it)
            self._ready.put(e)

    def _wait_at_gate(self, step: int) -> None:
        started = time.perf_counter()
        with self._gate:
            while not self._stopped and step - 1 - self._trained > self.max_staleness:
                self._gate.wait()
            self._gated_s += time.perf_counter() - started
            if self._stopped:
                raise _Stopped

    # ---- the consumer -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[int, dict]]:
        last_end, gated_before = time.perf_counter(), 0.0
        for step in range(self.first, self.last + 1):
            waited_from = time.perf_counter()
            rollout = self._take()
            waited = time.perf_counter() - waited_from
            version = self._version()
            kept, ages = fresh_groups(rollout, self.group_size, version, self.max_staleness)
            dropped = len(rollout.completions) - len(kept.completions)
            self.dropped += dropped
            if dropped:
                self._on_drop(step, dropped)
            with self._gate:
                gated, gated_before = self._gated_s - gated_before, self._gated_s
            wall = max(time.perf_counter() - last_end, 1e-9)
            extra = {
                "staleness_mean": sum(ages) / len(ages) if ages else 0.0,
                "staleness_max": float(max(ages, default=0)),
                **{f"staleness/{k}": sum(a == k for a in ages) / max(len(ages), 1) for k in range(self.max_staleness + 1)},
                # samples whose tokens came from more than one version (an update reached the
                # engine while they generated: the pause policy)
                "samples_mixed_frac": sum(len({v for v, _ in c.versions}) > 1 for c in kept.completions)
                / max(len(kept.completions), 1),
                "samples_dropped": float(dropped),
                "samples_dropped_total": float(self.dropped),
                "queue_depth": float(self._ready.qsize()),
                "trainer_wait_s": waited,
                "trainer_idle_frac": min(1.0, waited / wall),
                "engine_idle_frac": min(1.0, gated / wall),
                "generated_version": float(rollout.version),
            }
            metrics = self._learn(kept, extra)  # (one with no samples left emits a step that trains nothing)
            last_end = time.perf_counter()
            with self._gate:
                self._trained = step
                self._gate.notify_all()
            yield step, metrics

    def _take(self) -> Rollout:
        while True:
            self._check_cancelled()
            try:
                item = self._ready.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def close(self) -> None:
        """Stop the producer (a generation it has started runs to its end; its samples are dropped)."""
        with self._gate:
            self._stopped = True
            self._gate.notify_all()
        self._thread.join(timeout=1.0)
