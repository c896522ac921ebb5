"""A trainer that dies mid-job while the coordinator lives (a pod killed or drained) does not fail
the job: the coordinator waits until a trainer answers where discovery now says one is, and runs
the job on from its last checkpoint, as a restarted coordinator would. Without a checkpoint, or
with trainer restarts turned off, the job fails saying why; a cancel during the wait still works."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import textwrap
import time
from dataclasses import dataclass

import pytest

from services.coordinator.discovery import StaticDiscovery, make_fleet
from services.coordinator.jobs import JobManager
from services.launcher import LocalFleet
from tests.conftest import stop_fleet

pytestmark = pytest.mark.faults
ENV = {"OMP_NUM_THREADS": "1"}


def _job(tmp_path, model, train, test, *, checkpoint_every: int, num_trainers: int = 1, extra: str = "") -> str:
    return extra + textwrap.dedent(f"""
        name: losing-trainer
        seed: 3
        model: {model}
        num_rollout: 8
        output_dir: {tmp_path / "out"}
        rollout: {{prompts_per_step: 4, samples_per_prompt: 4, sampling: {{max_new_tokens: 3}}}}
        data: {{train: {train}}}
        eval: {{every: 0, datasets: [{{name: heldout, path: {test}, limit: 8, sampling: {{max_new_tokens: 3}}}}]}}
        trainer: {{num_trainers: {num_trainers}, optimizer: {{lr: 0.01}}}}
        checkpoint: {{every: {checkpoint_every}}}
        """)


@dataclass
class _Fleet:
    """Workers as local processes, a static discovery of them, and a JobManager over it; `later`
    starts the processes that come back (a restarted pod) at other addresses."""

    local: LocalFleet
    later: LocalFleet
    trainers: list
    critics: list
    engine: object
    discovery: StaticDiscovery
    manager: JobManager | None = None

    def start_manager(self, tmp_path, **settings) -> JobManager:
        self.manager = JobManager(make_fleet(self.discovery, wait_s=30), runs_dir=tmp_path / "runs", **settings)
        return self.manager

    def replace(self, tmp_path, name: str, *, trainer: int | None = None, critic: int | None = None):
        """Start `name` and let discovery list it instead of trainer (or critic) number `index`."""
        new = _trainer(self.later, name, tmp_path)
        self.later.wait_ready()
        trainers, _, critics = self.addresses()
        if trainer is not None:
            trainers[trainer] = new.address
        if critic is not None:
            critics[critic] = new.address
        self.discovery._ready.replace(trainers, [self.engine.address], critics)
        return new

    def addresses(self) -> tuple[list[str], list[str], list[str]]:
        return self.discovery.trainers(), self.discovery.rollouts(), self.discovery.critics()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One rollout engine for every test here: each job configures it afresh, and no test harms it
    (they kill trainers and critics)."""
    local = LocalFleet(tmp_path_factory.mktemp("engine-logs"), env=ENV)
    try:
        child = local.start("rollout", "rollout-0", [])
        local.wait_ready()
        yield child
    finally:
        stop_fleet(local, log_lines=10)


@contextlib.contextmanager
def _fleet(tmp_path, engine, trainers: int = 1, critics: int = 0):
    assert engine.process.poll() is None, "the shared engine died in an earlier test"
    local = LocalFleet(tmp_path / "logs", env=ENV)
    later = LocalFleet(tmp_path / "logs-later", env=ENV)
    fleet = None
    try:
        ts = [_trainer(local, f"trainer-{i}", tmp_path) for i in range(trainers)]
        cs = [_trainer(local, f"critic-{i}", tmp_path) for i in range(critics)]
        local.wait_ready()
        discovery = StaticDiscovery([t.address for t in ts], [engine.address], [c.address for c in cs])
        fleet = _Fleet(local, later, ts, cs, engine, discovery)
        yield fleet
    finally:
        if fleet is not None and fleet.manager is not None:
            fleet.manager.close()
        stop_fleet(local, log_lines=10)
        stop_fleet(later, log_lines=10)


def _trainer(local: LocalFleet, name: str, tmp_path):
    return local.start("trainer", name, ["--checkpoint-root", str(tmp_path)])  # checkpoints under the test's folder


def _messages(manager, job_id) -> list[str]:
    return [e.data.get("message", "") for e in manager.store.events(job_id, 0, 10_000) if e.kind == "log"]


def _run_losing(manager, job_id, victim, on_kill=lambda: None, at_step: int = 3):
    """Follow the job; SIGKILL `victim` right after the step-`at_step` event, then call on_kill."""
    killed = False
    for event in manager.watch(job_id):
        if event.kind == "step" and event.step == at_step and not killed:
            os.kill(victim.process.pid, signal.SIGKILL)
            victim.process.wait()
            killed = True
            on_kill()
    return manager.get(job_id)


def _assert_resumed_once(manager, job_id, lost_address: str, output_dir) -> None:
    events = manager.store.events(job_id, 0, 10_000)
    restarts = [e for e in events if e.kind == "log" and "resumes from its checkpoint of step 2" in e.data["message"]]
    assert len(restarts) == 1, _messages(manager, job_id)
    restart, message = restarts[0].seq, restarts[0].data["message"]
    assert f"trainer {lost_address} lost after step 3" in message and "UNAVAILABLE" in message, message
    assert any("resumed from the checkpoint of step 2" in m for m in _messages(manager, job_id))
    before = [e.step for e in events if e.kind == "step" and e.seq < restart]
    after = [e for e in events if e.kind == "step" and e.seq > restart]
    assert before[:3] == [1, 2, 3] and before == list(range(1, len(before) + 1))  # the kill races step 4
    assert [e.step for e in after] == list(range(3, 9))
    # the replacement trainer loaded the step-2 weights: versions go on from there, as if never lost
    assert all(e.data["weights_version"] == e.step for e in after)
    assert manager.get(job_id).summary["weights_version"] == 8
    assert [m.step for m in manager.store.step_metrics(job_id)] == list(range(1, 9))
    assert [c.step for c in manager.store.checkpoints(job_id)] == [2, 4, 6, 8]
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 9))  # the re-run steps replaced their first lines


def test_a_job_resumes_from_its_checkpoint_on_a_replacement_trainer(tmp_path, tiny_model_dir, task_files, engine):
    with _fleet(tmp_path, engine) as fleet:
        manager = fleet.start_manager(tmp_path, trainer_wait_s=60)
        job = manager.create(_job(tmp_path, tiny_model_dir, *task_files, checkpoint_every=2), str(tmp_path))
        # the trainer pod dies... and comes back at another address
        final = _run_losing(manager, job.id, fleet.trainers[0], lambda: fleet.replace(tmp_path, "trainer-0b", trainer=0))
        assert final.state == "succeeded", (final.error, _messages(manager, job.id)[-5:])
        _assert_resumed_once(manager, job.id, fleet.trainers[0].address, tmp_path / "out")


@pytest.mark.parametrize(("checkpoint_every", "restarts", "why"), [
    (0, 3, "and the job has no checkpoint to resume from; set checkpoint.every"),
    (2, 0, "trainer restarts are off (--trainer-restarts 0)"),
], ids=["without-checkpoints", "restarts-off"])
def test_a_job_that_cannot_restart_fails_saying_why(tmp_path, tiny_model_dir, task_files, engine, checkpoint_every,
                                                    restarts, why):
    with _fleet(tmp_path, engine) as fleet:
        manager = fleet.start_manager(tmp_path, trainer_restarts=restarts)
        job = manager.create(_job(tmp_path, tiny_model_dir, *task_files, checkpoint_every=checkpoint_every),
                             str(tmp_path))
        started = time.monotonic()
        final = _run_losing(manager, job.id, fleet.trainers[0])
        assert time.monotonic() - started < 60  # it fails at once: there is nothing to wait for
        assert final.state == "failed"
        assert final.error.startswith(f"TrainerLost: trainer {fleet.trainers[0].address} lost after step 3"), final.error
        assert why in final.error, final.error
        assert not any("resumes from" in m for m in _messages(manager, job.id))


def test_a_job_waiting_for_its_lost_trainer_can_be_cancelled(tmp_path, tiny_model_dir, task_files, engine):
    with _fleet(tmp_path, engine) as fleet:  # the dead address stays listed
        manager = fleet.start_manager(tmp_path, trainer_wait_s=600)
        job = manager.create(_job(tmp_path, tiny_model_dir, *task_files, checkpoint_every=2), str(tmp_path))
        killed, cancelled_at = False, None
        for event in manager.watch(job.id):
            if event.kind == "step" and event.step == 3 and not killed:
                os.kill(fleet.trainers[0].process.pid, signal.SIGKILL)
                killed = True
            if event.kind == "log" and "resumes from its checkpoint" in event.data["message"]:
                manager.cancel(job.id)
                cancelled_at = time.monotonic()
        final = manager.get(job.id)
        assert final.state == "cancelled", (final.error, _messages(manager, job.id)[-5:])
        assert time.monotonic() - cancelled_at < 5  # not at the end of the 600 s wait


def test_a_two_rank_trainer_group_that_loses_a_rank_resumes(tmp_path, tiny_model_dir, task_files, engine):
    with _fleet(tmp_path, engine, trainers=2) as fleet:
        manager = fleet.start_manager(tmp_path, trainer_wait_s=60)
        job = manager.create(_job(tmp_path, tiny_model_dir, *task_files, checkpoint_every=2, num_trainers=2),
                             str(tmp_path))
        rank1 = fleet.trainers[1]
        final = _run_losing(manager, job.id, rank1, lambda: fleet.replace(tmp_path, "trainer-1b", trainer=1))
        assert final.state == "succeeded", (final.error, _messages(manager, job.id)[-5:])
        # rank 0 lived on and was configured again, into a group with the new rank 1
        _assert_resumed_once(manager, job.id, rank1.address, tmp_path / "out")


def test_a_ppo_job_that_loses_its_critic_resumes_with_the_critics_checkpoint(tmp_path, tiny_model_dir, task_files,
                                                                            engine):
    with _fleet(tmp_path, engine, critics=1) as fleet:
        manager = fleet.start_manager(tmp_path, trainer_wait_s=60)
        ppo = "algorithm: {advantage: ppo}\ncritic: {optimizer: {lr: 0.01}}\n"
        job = manager.create(_job(tmp_path, tiny_model_dir, *task_files, checkpoint_every=2, extra=ppo), str(tmp_path))
        critic = fleet.critics[0]  # the critic pod dies and comes back elsewhere
        final = _run_losing(manager, job.id, critic, lambda: fleet.replace(tmp_path, "critic-0b", critic=0))
        assert final.state == "succeeded", (final.error, _messages(manager, job.id)[-5:])
        _assert_resumed_once(manager, job.id, critic.address, tmp_path / "out")
        # the new critic went on from the step-2 critic checkpoint, and checkpointed its own
        assert all("value_loss" in m.metrics for m in manager.store.step_metrics(job.id))
        assert (tmp_path / "out" / "checkpoints" / "step-000008" / "critic" / "value_head.safetensors").exists()


def test_a_trainer_that_dies_during_a_sync_is_recognised_and_the_job_resumes(tmp_path, tiny_model_dir, task_files,
                                                                               engine, monkeypatch):
    """A sync whose trainer dies half-way fails with the engines' errors only (WeightSyncFailed
    names no trainer); the coordinator then finds the trainer silent and restarts the job all the same."""
    from services.coordinator import loop as loop_module

    with _fleet(tmp_path, engine) as fleet:
        trainer = fleet.trainers[0]
        real_sync = loop_module.RLLoop.sync_weights

        def dying_sync(self, step):
            if step == 3 and self.fleet.trainers[0].address == trainer.address:  # the first trainer, mid-sync
                os.kill(trainer.process.pid, signal.SIGKILL)
                trainer.process.wait()
                fleet.replace(tmp_path, "trainer-0b", trainer=0)
                raise loop_module.WeightSyncFailed("weight sync to version 3 failed on every engine: {0: 'stream cut'}")
            return real_sync(self, step)

        monkeypatch.setattr(loop_module.RLLoop, "sync_weights", dying_sync)
        manager = fleet.start_manager(tmp_path, trainer_wait_s=60)
        job = manager.create(_job(tmp_path, tiny_model_dir, *task_files, checkpoint_every=2), str(tmp_path))
        for _ in manager.watch(job.id):  # to the job's end
            pass
        final = manager.get(job.id)
        messages = _messages(manager, job.id)
        assert final.state == "succeeded", (final.error, messages[-5:])
        restart = [m for m in messages if "resumes from its checkpoint of step 2" in m]
        assert len(restart) == 1 and f"trainer {trainer.address} lost" in restart[0] and "WeightSyncFailed" in restart[0]
        assert [m.step for m in manager.store.step_metrics(job.id)] == list(range(1, 9))


def test_a_resumed_dynamic_sampling_job_goes_on_with_the_data_and_seeds_it_left_at(tmp_path, tiny_model_dir, task_files,
                                                                                   engine):
    """Dynamic sampling draws a varying number of batches (and seeds) a step. The step that runs
    again after the resume must be the step that ran before: the same prompts and samples, so the
    same rewards and lengths, and the same place in the data after it."""
    extra = "rollout: {prompts_per_step: 4, samples_per_prompt: 4, sampling: {max_new_tokens: 3}, " \
            "dynamic_sampling: {max_rounds: 2}}\n"
    text = _job(tmp_path, tiny_model_dir, *task_files, checkpoint_every=2).replace(
        "rollout: {prompts_per_step: 4, samples_per_prompt: 4, sampling: {max_new_tokens: 3}}\n", extra)
    assert "dynamic_sampling" in text
    with _fleet(tmp_path, engine) as fleet:
        manager = fleet.start_manager(tmp_path, trainer_wait_s=60)
        job = manager.create(text, str(tmp_path))
        final = _run_losing(manager, job.id, fleet.trainers[0], lambda: fleet.replace(tmp_path, "trainer-0b", trainer=0))
        assert final.state == "succeeded", (final.error, _messages(manager, job.id)[-5:])
        events = manager.store.events(job.id, 0, 10_000)
        restart = next(e.seq for e in events if e.kind == "log" and "resumes from its checkpoint of step 2" in
                       e.data["message"])
        first = {e.step: e.data for e in events if e.kind == "step" and e.seq < restart}
        again = {e.step: e.data for e in events if e.kind == "step" and e.seq > restart}
        assert first[3]["batches_dealt"] > 3  # dynamic sampling drew more than a batch a step
        for key in ("reward_mean", "response_len_mean", "batches_dealt", "seeds_drawn", "generation_rounds"):
            assert again[3][key] == first[3][key], (key, first[3], again[3])
