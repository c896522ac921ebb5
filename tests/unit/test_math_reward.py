"""The math_verify reward: equivalent forms, the exact-match fast path, and a hard deadline per answer."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from services.coordinator import config as config_module
from services.coordinator.config import EvalConfig, EvalDatasetConfig, JobConfig, RewardConfig, check_packages
from services.coordinator.rewards import GuardedProcess, RewardError, RewardTimeout, build_reward

math_verify = pytest.importorskip("math_verify", reason="math-verify is not installed (pip install math-verify)")


@pytest.fixture(scope="module")
def reward():
    r = build_reward(RewardConfig(kind="math_verify", timeout_s=5))
    yield r
    r.close()


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("the answer is $\\frac{1}{2}$", "0.5", 1.0),
        ("\\boxed{\\dfrac12}", "1/2", 1.0),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),  # only math-verify sees these two as equal
        ("\\boxed{1 + x}", "x+1", 1.0),
        ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0),
        ("first 41, then \\boxed{42}", "42", 1.0),
        ("\\boxed{4}", "3", 0.0),
        ("\\boxed{\\sqrt{7}}", "2\\sqrt{2}", 0.0),
        ("no answer at all", "7", 0.0),
    ],
)
def test_equivalent_forms(reward, completion, answer, expected):
    assert reward(completion, answer, "p") == expected


def test_equal_strings_never_reach_math_verify(monkeypatch):
    r = build_reward(RewardConfig(kind="math_verify"))

    def refuse(*args, **kwargs):
        raise AssertionError("math_verify was called for an exact match")

    monkeypatch.setattr(r._guard, "call", refuse)
    assert r("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "p") == 1.0  # equal after normalisation
    assert r("it is 0.50", "1/2", "p") == 1.0  # equal as numbers
    assert r._guard._proc is None  # no process was even started


def test_a_pathological_answer_scores_zero_within_the_time_limit(reward):
    r = build_reward(RewardConfig(kind="math_verify", timeout_s=2))
    try:
        assert r("\\boxed{1}", "1", "p") == 1.0
        started = time.monotonic()
        assert r("\\boxed{9^{9^{9^{9}}}}", "1", "p") == 0.0  # sympy would evaluate this for a very long time
        assert r("\\boxed{(10^{10^{8}})!}", "2", "p") == 0.0
        assert time.monotonic() - started < 2 * 2 + 3  # two answers, each under its limit (+ a restart)
        assert r("\\boxed{\\dfrac{3}{4}}", "0.75", "p") == 1.0  # still working afterwards
    finally:
        r.close()


def test_the_guard_kills_a_call_that_ignores_signals_and_starts_a_new_process():
    guard = GuardedProcess()
    try:
        started = time.monotonic()
        with pytest.raises(RewardTimeout, match="sleep took longer than 0.5s"):
            guard.call(time.sleep, 60, timeout_s=0.5)
        assert time.monotonic() - started < 5
        assert guard.call(abs, -3, timeout_s=10) == 3
        assert guard.num_killed == 1
        with pytest.raises(RewardError, match="ValueError"):
            guard.call(int, "x", timeout_s=10)  # an exception in the child comes back as RewardError
    finally:
        guard.close()


def test_scores_from_a_job_thread(reward):
    # The coordinator scores in job threads, where math-verify's own SIGALRM timeout refuses to run.
    results = []
    thread = threading.Thread(target=lambda: results.append(reward("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", "p")))
    thread.start()
    thread.join(60)
    assert results == [1.0]


def test_a_missing_package_is_named_at_config_validation(monkeypatch):
    real = config_module.importlib.util.find_spec
    monkeypatch.setattr(config_module.importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    job = JobConfig(name="j", model=Path("/m"), num_rollout=0, reward=RewardConfig(kind="math_verify"),
                    eval=EvalConfig(datasets=(EvalDatasetConfig(name="t", path=Path("/t.jsonl")),)))
    with pytest.raises(config_module.ConfigError, match=r"reward.kind: needs the math-verify package, .*\(pip install math-verify\)"):
        check_packages(job)
    with pytest.raises(RewardError, match="math-verify"):
        build_reward(RewardConfig(kind="math_verify"))
