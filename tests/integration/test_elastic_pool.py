"""An elastic engine pool on real processes: during an 8-step job an engine is added at step 3
(the coordinator's ScaleEngines) and another is SIGKILLed at step 5. The job succeeds, the new
engine joins at the trainer's current version and serves, every step trains on all of its
samples (none lost, none counted twice), and a bad ScaleEngines call is refused by name."""

from __future__ import annotations

import json
import textwrap

import grpc
import pytest

from services import rpc
from services.api import coordinator_pb2, coordinator_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from services.launcher import LocalFleet
from tests.conftest import stop_fleet

pytestmark = pytest.mark.faults


def _job(name, model, train, test, out, algorithm: str) -> str:
    return textwrap.dedent(f"""
        name: {name}
        seed: 4
        model: {model}
        num_rollout: 8
        output_dir: {out}
        rollout: {{prompts_per_step: 6, samples_per_prompt: 4, num_engines: 2, elastic: true,
                   sampling: {{max_new_tokens: 6}}}}
        data: {{train: {train}}}
        eval: {{every: 0, datasets: [{{name: h, path: {test}, limit: 8, sampling: {{temperature: 0.0, max_new_tokens: 3}}}}]}}
        trainer: {{optimizer: {{lr: 0.01}}}}
        algorithm: {{advantage: grpo{algorithm}}}
        weight_sync: {{timeout_s: 20}}
        """)


@pytest.fixture
def workers(tmp_path):
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    try:
        trainer = local.start("trainer", "trainer-0", [])
        engines = [local.start("rollout", f"rollout-{i}", []) for i in range(3)]
        local.wait_ready()
        coordinator = local.start("coordinator", "coordinator",
                                  ["--trainers", trainer.address, "--rollouts", ",".join(e.address for e in engines[:2]),
                                   "--runs-dir", str(tmp_path / "runs"), "--db", "memory"])
        local.wait_ready()
        yield coordinator, engines
    finally:
        stop_fleet(local, log_lines=20)


@pytest.mark.parametrize("algorithm", ["", ", async: {max_staleness: 1}"], ids=["sync", "async"])
def test_an_engine_added_and_one_killed_mid_job(workers, tiny_model_dir, task_files, tmp_path, algorithm):
    coordinator, engines = workers
    train, test = task_files
    with rpc.open_channel(coordinator.address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        job = stub.CreateJob(coordinator_pb2.CreateJobRequest(
            config_yaml=_job("elastic", tiny_model_dir, train, test, tmp_path / "out", algorithm)), timeout=30)
        events = []
        for event in stub.WatchJob(coordinator_pb2.WatchJobRequest(job_id=job.id), timeout=240):
            events.append(event)
            if event.kind == "step" and event.step == 3:
                reply = stub.ScaleEngines(coordinator_pb2.ScaleEnginesRequest(
                    rollouts=[e.address for e in engines]), timeout=30)
                assert list(reply.rollouts) == [e.address for e in engines]
            if event.kind == "step" and event.step == 5:
                engines[1].process.kill()  # SIGKILL, mid-job
        final = stub.GetJob(coordinator_pb2.GetJobRequest(job_id=job.id), timeout=30)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    steps = {e.step: json.loads(e.data_json) for e in events if e.kind == "step"}
    assert sorted(steps) == list(range(1, 9))
    assert all(m["samples"] == 6 * 4 for m in steps.values())  # no group lost, none twice
    logs = [(e.step, json.loads(e.data_json)) for e in events if e.kind == "log"]
    joins = [(step, data) for step, data in logs if data.get("engine") == engines[2].address]
    assert len(joins) == 1
    step, data = joins[0]
    assert 4 <= step <= 5 and data["joined_version"] == step - 1  # the weights of the step it joined before
    syncs = [json.loads(e.data_json) for e in events if e.kind == "weight_sync"]
    # the killed engine left the pool: its sync, or a generation sent to it, failed
    assert any(engines[1].address in s["failures"] for s in syncs) or any(
        "left the pool" in data["message"] and engines[1].address in data["message"] for _, data in logs)
    assert syncs[-1]["version"] == 8 and syncs[-1]["engines_in_pool"] == 2  # engines 0 and 2
    with rpc.open_channel(engines[2].address) as ch:
        status = rollout_pb2_grpc.RolloutStub(ch).GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=30)
    assert status.weight_version == 8 and status.load.rounds > 0  # it served, and has the final weights
    summary = json.loads(final.summary_json)
    assert summary["steps"] == 8 and summary["weights_version"] == 8


def test_a_bad_engine_list_is_refused_by_name(workers):
    coordinator, engines = workers
    with rpc.open_channel(coordinator.address) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        for rollouts, message in (([], "at least one engine"), (["nohost"], "not host:port: 'nohost'"),
                                  ([engines[0].address] * 2, "listed twice")):
            with pytest.raises(grpc.RpcError) as info:
                stub.ScaleEngines(coordinator_pb2.ScaleEnginesRequest(rollouts=rollouts), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
