"""A coordinator killed mid-job resumes it from the last checkpoint when it starts again: same
data order, same sampling seeds, so every step after the checkpoint and the final eval come out as
in a run that was never killed. Without a checkpoint the job is marked failed, as before."""

from __future__ import annotations

import os
import signal
import textwrap

import pytest

from services import rpc
from services.api import coordinator_pb2, coordinator_pb2_grpc
from services.launcher import LocalFleet
from tests.conftest import stop_fleet

pytestmark = pytest.mark.faults
SKIP_NOISE = ("_s", "time", "wake", "sleep")  # wall-clock timings differ from run to run


def _job(name: str, out, model, train, test, checkpoint_every: int) -> str:
    return textwrap.dedent(f"""
        name: {name}
        seed: 5
        model: {model}
        num_rollout: 6
        output_dir: {out}
        rollout: {{prompts_per_step: 4, samples_per_prompt: 4, sampling: {{max_new_tokens: 4}}}}
        data: {{train: {train}}}
        eval: {{every: 0, datasets: [{{name: h, path: {test}, limit: 8, sampling: {{max_new_tokens: 3}}}}]}}
        trainer: {{optimizer: {{lr: 0.02}}}}
        checkpoint: {{every: {checkpoint_every}}}
        """)


def _coordinator(local: LocalFleet, trainer, engine, db, name: str):
    child = local.start("coordinator", name, ["--trainers", trainer.address, "--rollouts", engine.address,
                                              "--db", str(db)])
    local.wait_ready()
    return child


def _watch_until(address: str, job_id: str, done) -> None:
    with rpc.open_channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        for event in stub.WatchJob(coordinator_pb2.WatchJobRequest(job_id=job_id), timeout=240):
            if done(event):
                return


def _results(address: str, job_id: str):
    with rpc.open_channel(address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        final = stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job_id), timeout=30)
        metrics = stub.GetJobMetrics(coordinator_pb2.GetJobMetricsRequest(job_id=job_id), timeout=30)
    steps = {m.step: {k: v for k, v in m.metrics.items() if not any(n in k for n in SKIP_NOISE)} for m in metrics.steps}
    return final, steps, [(e.step, e.dataset, e.score) for e in metrics.evals]


def _submit(address: str, text: str) -> str:
    with rpc.open_channel(address) as ch:
        return coordinator_pb2_grpc.CoordinatorStub(ch).CreateJob(
            coordinator_pb2.CreateJobRequest(config_yaml=text), timeout=30).id


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """A trainer and an engine for both cases: each job configures them afresh, and only
    coordinators are killed here."""
    local = LocalFleet(tmp_path_factory.mktemp("resume-logs"), env={"OMP_NUM_THREADS": "1"})
    try:
        # checkpoints of jobs writing under any test's tmp_path, and nowhere else
        trainer = local.start("trainer", "trainer-0", ["--checkpoint-root", str(tmp_path_factory.getbasetemp())])
        engine = local.start("rollout", "rollout-0", [])
        local.wait_ready()
        yield trainer, engine
    finally:
        stop_fleet(local, log_lines=15)


@pytest.mark.parametrize("checkpoint_every", [2, 0], ids=["with-checkpoints", "without"])
def test_a_killed_coordinator_resumes_its_job_from_the_last_checkpoint(tmp_path, tiny_model_dir, task_files,
                                                                      workers, checkpoint_every):
    train, test = task_files
    trainer, engine = workers
    assert trainer.process.poll() is None and engine.process.poll() is None, "a shared worker died in an earlier test"
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    try:
        db = tmp_path / "jobs.db"
        first = _coordinator(local, trainer, engine, db, "coordinator-1")
        job_id = _submit(first.address, _job("killed", tmp_path / "killed", tiny_model_dir, train, test, checkpoint_every))
        _watch_until(first.address, job_id, lambda e: e.kind == "step" and e.step == 3)  # past the step-2 checkpoint
        os.kill(first.process.pid, signal.SIGKILL)
        first.process.wait()
        local.children.remove(first)  # dead on purpose
        second = _coordinator(local, trainer, engine, db, "coordinator-2")
        _watch_until(second.address, job_id, lambda e: e.kind == "state" and e.state in (
            coordinator_pb2.JOB_STATE_SUCCEEDED, coordinator_pb2.JOB_STATE_FAILED))
        final, steps, evals = _results(second.address, job_id)
        if not checkpoint_every:
            assert final.state == coordinator_pb2.JOB_STATE_FAILED and "no checkpoint to resume from" in final.error
            return
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
        # the same job, never killed, on the same workers
        reference_id = _submit(second.address, _job("never-killed", tmp_path / "ref", tiny_model_dir, train, test, 2))
        _watch_until(second.address, reference_id, lambda e: e.kind == "state" and e.state in (
            coordinator_pb2.JOB_STATE_SUCCEEDED, coordinator_pb2.JOB_STATE_FAILED))
        reference, reference_steps, reference_evals = _results(second.address, reference_id)
        assert reference.state == coordinator_pb2.JOB_STATE_SUCCEEDED, reference.error
        assert sorted(steps) == list(range(1, 7))
        for step in range(1, 7):
            assert steps[step] == pytest.approx(reference_steps[step], rel=1e-5, abs=1e-7), step
        assert [e[:2] for e in evals] == [e[:2] for e in reference_evals]
        assert [e[2] for e in evals] == pytest.approx([e[2] for e in reference_evals])
        lines = (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 6  # the re-run steps replaced their first lines
    finally:
        stop_fleet(local, log_lines=15)
