"""Weight updates while callers stream, on every CPU data plane, between real processes: with
`pause` the update does not wait for the rows generating, which go on under the new weights, and
every completion says which of its tokens came from which version. With `abort` the rows
running come back at once, marked, with their tokens so far.

What is checked against a complete version computed here (greedy, from the trainer's weights at
that version): a completion made under one version alone equals that version's answer; one that
spans versions starts with exactly that version's first tokens, as many as it claims. (Tokens
after a swap attend to keys and values the old version wrote, so no single version's forward
recomputes them; tests/unit/test_serving.py checks those token by token, with versions that leave
the cache unchanged.)"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.api import rollout_pb2, trainer_pb2
from services.coordinator.clients import PeerError, RolloutClient
from tests.conftest import make_syncer
from tests.integration.test_never_mixed import PROMPTS, SAMPLE, TOLERANCE, _Reference, model_dir, trainer_and_engine  # noqa: F401

pytestmark = pytest.mark.faults

MAX_NEW = 40
UPDATES = 5


class _Streams:
    """GenerateStream calls back to back from two threads until stopped; keeps every completion."""

    def __init__(self, engine: RolloutClient, prompts_ids: list[list[int]]):
        self._engine, self._prompts, self._stop = engine, prompts_ids, threading.Event()
        self.completions: list = []
        self.errors: list[str] = []
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self) -> None:
        # (a stop string that never comes: the batch is looked at every step, so updates land mid-row)
        sampling = rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True,
                                              stop=["never said"])
        while not self._stop.is_set():
            try:
                for index, completion in self._engine.generate_stream(self._prompts, sampling):
                    self.completions.append((index, completion))
            except PeerError as e:
                self.errors.append(str(e))

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def _check_against(reference: _Reference, completions) -> int:
    """Assert each completion agrees with the complete versions it claims; how many span versions."""
    spanning = 0
    for index, c in completions:
        assert sum(n for _, n in c.versions) == len(c.output_ids), c.versions
        claimed = [v for v, _ in c.versions]
        assert claimed == sorted(claimed) and c.weight_version == claimed[0]
        expected_ids, expected_logprobs = reference.answers[claimed[0]][index]
        first = c.versions[0][1] if c.finish_reason != "abort" or len(c.versions) > 1 else len(c.output_ids)
        assert c.output_ids[:first] == expected_ids[:first], (index, c.versions)
        assert max((abs(a - b) for a, b in zip(c.logprobs[:first], expected_logprobs)), default=0) < TOLERANCE
        spanning += len(c.versions) > 1
    return spanning


def _streams_across_updates(tmp_path, model_dir, plane: str, policy: str, updates: int, rollout_args: tuple = ()):
    """Streaming clients of one engine while the trainer steps and syncs `updates` times with
    `policy`; the reference answers of every version, and the streams."""
    with trainer_and_engine(tmp_path / "logs", model_dir, rollout_args=rollout_args) as (trainer, engine):
        reference = _Reference(model_dir, trainer, "cpu", max_new=MAX_NEW)
        reference.record()
        prompts_ids = [reference._engine.tokenizer.encode(p) for p in PROMPTS]
        pool = ThreadPoolExecutor(4)
        syncer = make_syncer(trainer, [engine], pool, plane=plane, timeout_s=30.0)
        syncer.policy = policy
        try:
            with _Streams(engine, prompts_ids) as streams:
                for _ in range(updates):
                    time.sleep(0.3)  # streams are mid-row
                    trainer.train_step(trainer_pb2.Batch(samples=[SAMPLE]))
                    assert syncer.sync({0}).ok == {0}
                    reference.record()
                time.sleep(0.5)
        finally:
            syncer.close()
            pool.shutdown()
    return reference, streams


@pytest.mark.parametrize("plane, front_end", [("grpc_stream", "inline"), ("shm", "inline"), ("broadcast", "inline"),
                                              ("shm", "process")])
def test_streams_run_across_five_pause_updates(tmp_path, model_dir, plane, front_end):
    """(`front_end` process: the engine's server behind a front end in its own process, the
    streams forwarded over its link while the updates go to the engine's process.)"""
    reference, streams = _streams_across_updates(tmp_path, model_dir, plane, "pause", UPDATES,
                                                 ("--front-end", front_end))
    assert not streams.errors, streams.errors[:3]
    assert len(streams.completions) >= 8 * UPDATES
    spanning = _check_against(reference, streams.completions)
    assert spanning >= 2  # rows went on across an update instead of the update waiting for them
    assert {v for _, c in streams.completions for v, _ in c.versions} >= set(range(1, UPDATES + 1))


def test_abort_returns_running_rows_at_once_marked_with_their_tokens(tmp_path, model_dir):
    reference, streams = _streams_across_updates(tmp_path, model_dir, "grpc_stream", "abort", 2)
    assert not streams.errors, streams.errors[:3]
    aborted = [c for _, c in streams.completions if c.finish_reason == "abort"]
    assert aborted and all(len(c.output_ids) < MAX_NEW and len(c.versions) == 1 for c in aborted)
    assert all(len(c.output_ids) == MAX_NEW for _, c in streams.completions if c.finish_reason != "abort")
    assert _check_against(reference, streams.completions) == 0  # nothing spans versions under abort
