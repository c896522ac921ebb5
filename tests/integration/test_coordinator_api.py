"""The coordinator's job API against a real `rlfleet serve coordinator` process (REST and gRPC,
token required, SQLite job store) driving the real trainer and rollout processes of the session
fleet: create / get / list / cancel / watch, idempotent creates, auth, SIGKILL mid-run and a
restart on the same database, the `rlfleet` job commands, and a token that never reaches a log.
The tests run as one sequence over one module fixture (the restart needs the job started before it)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services import cli, rpc
from services.api import coordinator_pb2 as pb
from services.api import coordinator_pb2_grpc
from services.coordinator.jobs import RESTART_REASON
from tests.integration.conftest import addresses

TOKEN = "tok-" + secrets.token_hex(12)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Coordinator:
    process: subprocess.Popen
    port: int
    http_port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stub(self, token: str | None = TOKEN) -> coordinator_pb2_grpc.CoordinatorStub:
        return coordinator_pb2_grpc.CoordinatorStub(rpc.open_channel(self.address, token))


def start_coordinator(workdir: Path, fleet, name: str) -> Coordinator:
    addrs = addresses(fleet)
    ready = workdir / f"{name}.ready"
    log_path = workdir / f"{name}.log"
    (workdir / "token").write_text(TOKEN + "\n")
    cmd = [sys.executable, "-m", "services.cli", "serve", "coordinator", "--port", "0", "--http-port", "0",
           "--db", str(workdir / "jobs.db"), "--token-file", str(workdir / "token"), "--ready-file", str(ready),
           "--trainers", addrs["trainer"], "--rollouts", addrs["rollout"], "--runs-dir", str(workdir / "runs"),
           "--log-level", "DEBUG"]
    with open(log_path, "ab") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert process.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "coordinator did not start"
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return Coordinator(process, info["port"], info["http_port"], log_path)


def job_yaml(model_dir, train, test, name: str, num_rollout: int) -> str:
    return textwrap.dedent(
        f"""
        name: {name}
        model: {model_dir}
        num_rollout: {num_rollout}
        rollout: {{prompts_per_step: 2, samples_per_prompt: 2, sampling: {{max_new_tokens: 2}}}}
        data: {{train: {train}}}
        eval: {{every: 0, datasets: [{{name: heldout, path: {test}, limit: 2, sampling: {{max_new_tokens: 2}}}}]}}
        trainer: {{micro_batch_size: 8, optimizer: {{lr: 0.001}}}}
        weight_sync: {{bucket_mb: 1}}
        """
    )


@pytest.fixture(scope="module")
def env(fleet, tmp_path_factory, tiny_model_dir, task_files):
    workdir = tmp_path_factory.mktemp("coordinator-api")
    state = {"workdir": workdir, "coordinator": start_coordinator(workdir, fleet, "first"), "fleet": fleet,
             "long": job_yaml(tiny_model_dir, *task_files, "long", 10_000),
             "short": job_yaml(tiny_model_dir, *task_files, "short", 2)}
    yield state
    for key in ("coordinator", "restarted"):
        if key in state and state[key].process.poll() is None:
            state[key].process.send_signal(signal.SIGTERM)
            state[key].process.wait(20)


def test_token_is_required_on_rest_and_grpc_but_health_stays_open(env):
    c: Coordinator = env["coordinator"]
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert httpx.get(f"{c.url}/v1/jobs", headers=headers).status_code == 401
    assert httpx.get(f"{c.url}/v1/jobs", headers=AUTH).status_code == 200
    assert httpx.get(f"{c.url}/healthz").json() == {"status": "ok"}
    assert "rlfleet_jobs" in httpx.get(f"{c.url}/metrics").text
    for token in (None, "wrong"):
        for call in (lambda s: s.ListJobs(pb.ListJobsRequest(), timeout=10),
                     lambda s: list(s.WatchJob(pb.WatchJobRequest(job_id="x"), timeout=10))):
            with pytest.raises(grpc.RpcError) as err:
                call(c.stub(token))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(rpc.open_channel(c.address)).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_create_list_cancel_and_watch_over_rest_and_grpc(env):
    c: Coordinator = env["coordinator"]
    stub = c.stub()
    body = {"config_yaml": env["long"], "request_id": "long-1"}
    created = httpx.post(f"{c.url}/v1/jobs", json=body, headers=AUTH)
    assert created.status_code == 201, created.text
    long_id = created.json()["id"]
    retried = httpx.post(f"{c.url}/v1/jobs", json=body, headers=AUTH)
    assert retried.status_code == 200 and retried.json()["id"] == long_id
    over_grpc = stub.CreateJob(pb.CreateJobRequest(config_yaml=env["long"], request_id="long-1"), timeout=30)
    assert over_grpc.id == long_id
    env["long_id"] = long_id

    bad = httpx.post(f"{c.url}/v1/jobs", json={"config_yaml": env["long"].replace("num_rollout", "num_rollouts")},
                     headers=AUTH)
    assert bad.status_code == 400 and "num_rollouts" in bad.json()["detail"]
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateJob(pb.CreateJobRequest(config_yaml="name: x\nnum_rollout: -1\nmodel: /m\n"), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    queued = stub.CreateJob(pb.CreateJobRequest(config_yaml=env["short"]), timeout=30)  # waits behind "long"
    assert queued.state == pb.JOB_STATE_PENDING
    pending = httpx.get(f"{c.url}/v1/jobs", params={"state": "pending"}, headers=AUTH).json()["jobs"]
    assert [j["id"] for j in pending] == [queued.id]
    first = stub.ListJobs(pb.ListJobsRequest(page_size=1), timeout=10)
    second = stub.ListJobs(pb.ListJobsRequest(page_size=1, page_token=first.next_page_token), timeout=10)
    assert [first.jobs[0].id, second.jobs[0].id] == [queued.id, long_id] and not second.next_page_token
    cancelled = stub.CancelJob(pb.CancelJobRequest(job_id=queued.id), timeout=10)
    assert cancelled.state == pb.JOB_STATE_CANCELLED
    assert httpx.post(f"{c.url}/v1/jobs/{queued.id}:cancel", headers=AUTH).json()["state"] == "cancelled"
    assert httpx.get(f"{c.url}/v1/jobs/nope", headers=AUTH).status_code == 404
    env["cancelled_id"] = queued.id

    # Follow the long job live over SSE until it has trained three steps.
    seen = []
    with httpx.stream("GET", f"{c.url}/v1/jobs/{long_id}/events", headers=AUTH, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[len("data: "):]))
                if sum(e["kind"] == "step" for e in seen) >= 3:
                    break
    assert [e["seq"] for e in seen] == list(range(1, len(seen) + 1))
    assert seen[0]["state"] == "pending" and seen[-1]["state"] == "running"
    replay = list(stub.WatchJob(pb.WatchJobRequest(job_id=long_id, replay_only=True), timeout=30))
    assert [(e.seq, e.kind) for e in replay[: len(seen)]] == [(e["seq"], e["kind"]) for e in seen]
    env["events_before_kill"] = [(e.seq, e.kind, e.step, e.data_json) for e in replay]
    assert httpx.get(f"{c.url}/v1/jobs/{long_id}", headers=AUTH).json()["state"] == "running"


def _needs(env, key: str) -> None:
    if key not in env:
        pytest.skip(f"the tests of this module run as one sequence; {key!r} comes from an earlier one")


def test_sigkill_and_restart_keep_every_job_and_event(env):
    _needs(env, "events_before_kill")
    c: Coordinator = env["coordinator"]
    long_id = env["long_id"]
    os.kill(c.process.pid, signal.SIGKILL)
    c.process.wait(10)
    env["restarted"] = restarted = start_coordinator(env["workdir"], env["fleet"], "restarted")
    stub = restarted.stub()
    job = stub.GetJob(pb.GetJobRequest(job_id=long_id), timeout=10)
    assert job.state == pb.JOB_STATE_FAILED and job.error == RESTART_REASON and job.step >= 3
    events = list(stub.WatchJob(pb.WatchJobRequest(job_id=long_id), timeout=30))
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    kinds = [e.kind for e in events]
    assert kinds.count("step") == job.step and "weight_sync" in kinds and "eval" in kinds
    assert events[-1].kind == "state" and json.loads(events[-1].data_json) == {"error": RESTART_REASON}
    assert events[-2].state == pb.JOB_STATE_RUNNING
    before = env["events_before_kill"]  # everything streamed before the kill is stored as it was
    assert [(e.seq, e.kind, e.step, e.data_json) for e in events[: len(before)]] == before
    metrics = httpx.get(f"{restarted.url}/v1/jobs/{long_id}/metrics", headers=AUTH).json()
    assert [s["step"] for s in metrics["steps"]] == list(range(1, job.step + 1))
    cancelled = stub.GetJob(pb.GetJobRequest(job_id=env["cancelled_id"]), timeout=10)
    assert cancelled.state == pb.JOB_STATE_CANCELLED
    again = httpx.post(f"{restarted.url}/v1/jobs", json={"config_yaml": env["long"], "request_id": "long-1"},
                       headers=AUTH)
    assert again.status_code == 200 and again.json()["id"] == long_id  # idempotent across the restart


def test_cli_submit_wait_status_logs_results_and_exit_codes(env, tmp_path, monkeypatch, capsys):
    _needs(env, "restarted")
    c: Coordinator = env["restarted"]
    monkeypatch.setenv("RLFLEET_COORDINATOR", c.address)
    monkeypatch.setenv("RLFLEET_TOKEN", TOKEN)
    job_file = tmp_path / "short.yaml"
    job_file.write_text(env["short"])
    assert cli.main(["submit", str(job_file), "--wait", "--request-id", "cli-1"]) == 0
    out, err = capsys.readouterr()
    job_id = out.strip()
    assert "succeeded" in err and "reward" in err  # the step table and the final line
    assert cli.main(["status"]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split() == ["ID", "NAME", "STATE", "STEP", "CREATED", "ERROR"]
    assert job_id in table and env["long_id"] in table
    assert cli.main(["status", job_id, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "succeeded"
    assert cli.main(["logs", job_id, "--kind", "step"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert cli.main(["results", job_id, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [e["step"] for e in results["evals"]] == [0, 2] and len(results["steps"]) == 2
    assert cli.main(["results", env["long_id"]]) == 1  # failed by the restart
    assert RESTART_REASON in capsys.readouterr().out

    # The same finished job over REST: SSE replay ends by itself, metrics and plot are there.
    events = httpx.get(f"{c.url}/v1/jobs/{job_id}/events", headers=AUTH, timeout=30).text
    assert events.count("event: step") == 2 and events.rstrip().endswith("}")
    png = httpx.get(f"{c.url}/v1/jobs/{job_id}/plots/reward.png", headers=AUTH)
    assert png.status_code == 200 and png.content.startswith(b"\x89PNG")
    assert 'rlfleet_jobs{state="succeeded"} 1.0' in httpx.get(f"{c.url}/metrics").text

    assert cli.main(["cancel", job_id]) == 1  # already succeeded
    assert cli.main(["status", "no-such-job"]) == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text(env["short"].replace("samples_per_prompt: 2", "samples_per_prompt: 1"))
    assert cli.main(["submit", str(bad)]) == 2
    assert cli.main(["submit", str(tmp_path / "missing.yaml")]) == 2
    assert "rollout.samples_per_prompt" in capsys.readouterr().err
    monkeypatch.setenv("RLFLEET_TOKEN", "wrong")
    assert cli.main(["status"]) == 5
    monkeypatch.setenv("RLFLEET_TOKEN", TOKEN)
    assert cli.main(["status", "--coordinator", "127.0.0.1:1", "--timeout", "5"]) == 3
    assert TOKEN not in capsys.readouterr().err


def test_the_token_never_reaches_a_log(env):
    """Both coordinator runs logged at DEBUG, served good and bad tokens over REST and gRPC."""
    _needs(env, "restarted")
    for key in ("coordinator", "restarted"):
        text = env[key].log_path.read_text()
        assert "serving on" in text and "bearer token required" in text
        assert TOKEN not in text
