"""Asynchronous RL's producer and consumer (`services.coordinator.pipeline`) with stand-in
generation and training: generation runs ahead of training by at most max_staleness steps, a
sample further behind than that is dropped and counted, a producer's error reaches the job, and
closing stops a producer that waits."""

from __future__ import annotations

import time

import pytest

from services.coordinator.clients import Completion
from services.coordinator.datasets import Example
from services.coordinator.pipeline import AsyncSteps, Rollout, fresh_groups, oldest_version


def _completion(version: int, runs: tuple = ()) -> Completion:
    return Completion(prompt_index=0, prompt_ids=[1], output_ids=[2, 3], text="", logprobs=[-1.0, -1.0],
                      finish_reason="length", weight_version=version, versions=runs)


def _rollout(step: int, versions: list[int], group_size: int = 2) -> Rollout:
    examples = [Example(prompt=f"p{i}", answer="", index=i) for i in range(len(versions))]
    completions = [_completion(v) for v in versions for _ in range(group_size)]
    return Rollout(step, examples, [e.prompt for e in examples], completions, 0.0, min(versions))


def test_a_sample_is_as_old_as_its_oldest_token():
    assert oldest_version(_completion(4, ((4, 3), (5, 2)))) == 4
    assert oldest_version(_completion(7)) == 7  # an engine that reports no runs: its first token's


def test_groups_with_a_token_too_far_behind_are_dropped_whole():
    rollout = _rollout(5, [3, 1, 4])
    kept, ages = fresh_groups(rollout, 2, version=4, max_staleness=2)
    assert [e.prompt for e in kept.examples] == ["p0", "p2"]
    assert len(kept.completions) == 4 and ages == [1, 1, 0, 0]
    same, _ = fresh_groups(rollout, 2, version=3, max_staleness=2)
    assert same is rollout


class _Trainer:
    """A stand-in trainer: each learn bumps the version; records what it trained."""

    def __init__(self, train_s: float = 0.01):
        self.version, self.train_s, self.trained = 0, train_s, []

    def learn(self, rollout: Rollout, extra: dict) -> dict:
        time.sleep(self.train_s)
        self.trained.append((rollout.step, extra))
        self.version += 1
        return {"step": rollout.step}


def _steps(trainer: _Trainer, produce, *, last: int, max_staleness: int, **kwargs) -> AsyncSteps:
    return AsyncSteps(first=1, last=last, max_staleness=max_staleness, group_size=2, produce=produce,
                      learn=trainer.learn, version=lambda: trainer.version, check_cancelled=lambda: None,
                      on_drop=kwargs.get("on_drop", lambda step, n: None))


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_generation_runs_ahead_by_at_most_max_staleness_steps(max_staleness):
    trainer = _Trainer()
    started = []  # (step, trainer version when its generation began)

    def produce(step):
        started.append((step, trainer.version))
        time.sleep(0.002)
        return _rollout(step, [trainer.version] * 2)

    steps = _steps(trainer, produce, last=10, max_staleness=max_staleness)
    out = list(steps)
    steps.close()
    assert [s for s, _ in out] == list(range(1, 11))
    assert all(step - 1 - version <= max_staleness for step, version in started)
    assert any(step - 1 - version == max_staleness for step, version in started)  # it did run ahead
    ages = [extra["staleness_max"] for _, extra in trainer.trained]
    assert max(ages) == max_staleness and all(a <= max_staleness for a in ages)
    assert all(extra["samples_dropped"] == 0 for _, extra in trainer.trained)


def test_samples_further_behind_than_the_bound_are_dropped_and_counted():
    trainer = _Trainer()
    drops = []

    def produce(step):  # an engine stuck on version 0
        return _rollout(step, [0, trainer.version])

    steps = _steps(trainer, produce, last=5, max_staleness=1, on_drop=lambda step, n: drops.append((step, n)))
    list(steps)
    steps.close()
    assert drops and all(n == 2 for _, n in drops)  # the stuck group, whole
    assert steps.dropped == sum(n for _, n in drops)
    assert all(extra["staleness_max"] <= 1 for _, extra in trainer.trained)


def test_a_producer_error_reaches_the_job():
    trainer = _Trainer()

    def produce(step):
        if step == 3:
            raise RuntimeError("no rollout engine left in the pool")
        return _rollout(step, [trainer.version])

    steps = _steps(trainer, produce, last=6, max_staleness=1)
    with pytest.raises(RuntimeError, match="no rollout engine"):
        list(steps)
    steps.close()
    assert [s for s, _ in trainer.trained] == [1, 2]


def test_close_stops_a_producer_waiting_at_the_gate():
    trainer = _Trainer()
    steps = _steps(trainer, lambda step: _rollout(step, [0]), last=50, max_staleness=1)
    deadline = time.monotonic() + 5
    while steps._ready.qsize() < 2 and time.monotonic() < deadline:  # steps 1 and 2 made, 3 waits
        time.sleep(0.001)
    steps.close()
    assert not steps._thread.is_alive()
    assert steps._ready.qsize() == 2
