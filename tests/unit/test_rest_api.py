"""The coordinator's REST API in process (ASGI): auth, errors, the shapes it promises, and a
schemathesis run over /openapi.json that must find no 5xx and no response outside the schema."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from fastapi.testclient import TestClient

from services.coordinator.jobs import JobManager
from services.coordinator.rest import create_app
from services.coordinator.store import MemoryJobStore

TOKEN = "s3cret-rest-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _no_workers(job):
    raise RuntimeError("no workers in this test")


def _eval_config(model_dir, eval_file, name="ev") -> dict:
    return {"name": name, "model": str(model_dir), "num_rollout": 0,
            "eval": {"datasets": [{"name": "h", "path": str(eval_file), "limit": 2}]}}


# Module level, because schemathesis builds its tests from the schema at collection time.
MANAGER = JobManager(_no_workers, runs_dir=Path(tempfile.gettempdir()) / "rlfleet-rest-test-runs", store=MemoryJobStore())
APP = create_app(MANAGER, TOKEN)
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module")
def api(tiny_model_dir, task_files):
    """The app (jobs fail at once: no workers), a client, and one finished job with metrics."""
    client = TestClient(APP)
    job = MANAGER.create(f"name: done\nmodel: {tiny_model_dir}\nnum_rollout: 0\n"
                         f"eval: {{datasets: [{{name: h, path: {task_files[1]}}}]}}\n", "/")
    store = MANAGER.store  # give the finished job some metrics, as a real run would have
    store.append_event(job.id, "step", time.time(), 1, {"reward_mean": 0.5, "generate_s": 0.1})
    store.append_event(job.id, "eval", time.time(), 1, {"dataset": "h", "score": 0.25, "num_prompts": 4})
    deadline = time.monotonic() + 10
    while MANAGER.get(job.id).state != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return APP, client, MANAGER, job.id


def test_token_is_required_on_v1_routes_only(api):
    _, client, _, job_id = api
    for path in ("/v1/jobs", f"/v1/jobs/{job_id}", "/v1/schema/job"):
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers={"Authorization": TOKEN}).status_code == 401  # no scheme
        assert client.get(path, headers=AUTH).status_code == 200
    denied = client.get("/v1/jobs")
    assert denied.headers["www-authenticate"] == "Bearer" and TOKEN not in denied.text
    assert client.post("/v1/jobs", json={"config_yaml": "x"}).status_code == 401  # before validation
    for open_path in ("/healthz", "/metrics", "/openapi.json"):
        assert client.get(open_path).status_code == 200


def test_create_get_list_cancel_and_errors(api, tiny_model_dir, task_files):
    _, client, manager, done_id = api
    config = _eval_config(tiny_model_dir, task_files[1], "rest-job")
    created = client.post("/v1/jobs", json={"config": config, "request_id": "rest-1"}, headers=AUTH)
    assert created.status_code == 201 and created.headers["location"] == f"/v1/jobs/{created.json()['id']}"
    again = client.post("/v1/jobs", json={"config": config, "request_id": "rest-1"}, headers=AUTH)
    assert again.status_code == 200 and again.json()["id"] == created.json()["id"]
    conflict = client.post("/v1/jobs", json={"config": {**config, "seed": 7}, "request_id": "rest-1"}, headers=AUTH)
    assert conflict.status_code == 409 and "rest-1" in conflict.json()["detail"]
    missing_model = f"name: y\nnum_rollout: 0\nmodel: /nowhere\neval: {{datasets: [{{name: h, path: {task_files[1]}}}]}}\n"
    as_yaml = client.post("/v1/jobs", json={"config_yaml": missing_model}, headers=AUTH)
    assert as_yaml.status_code == 400 and as_yaml.json()["detail"].startswith("model:")
    bad_field = {**config, "rollout": {"samples_per_prompt": "many"}}
    detail = client.post("/v1/jobs", json={"config": bad_field}, headers=AUTH).json()["detail"]
    assert "rollout.samples_per_prompt" in detail
    both = client.post("/v1/jobs", json={"config": config, "config_yaml": "x"}, headers=AUTH)
    assert both.status_code == 400 and "exactly one" in both.json()["detail"]
    assert client.get("/v1/jobs/nope", headers=AUTH).status_code == 404
    assert client.post("/v1/jobs/nope:cancel", headers=AUTH).status_code == 404
    finished = client.post(f"/v1/jobs/{done_id}:cancel", headers=AUTH)
    assert finished.status_code == 409 and "already failed" in finished.json()["detail"]
    listed = client.get("/v1/jobs", params={"state": "failed", "page_size": 1}, headers=AUTH).json()
    assert len(listed["jobs"]) == 1 and listed["next_page_token"]
    assert client.get("/v1/jobs", params={"page_token": "junk"}, headers=AUTH).status_code == 400
    misspelt = client.get("/v1/jobs", params={"pagesize": 1}, headers=AUTH)  # not silently ignored
    assert misspelt.status_code == 400 and "unknown parameter 'pagesize'" in misspelt.json()["detail"]
    assert client.get("/v1/jobs", params={"state": "asleep"}, headers=AUTH).status_code == 400


def test_events_metrics_plot_and_prometheus(api):
    _, client, manager, job_id = api
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=AUTH) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        text = "".join(stream.iter_text())
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert blocks[0].startswith("id: 1\nevent: state\ndata: {")
    assert [b.split("\n")[1] for b in blocks] == [f"event: {e.kind}" for e in manager.watch(job_id)]
    tail = client.get(f"/v1/jobs/{job_id}/events", params={"follow": "false"},
                      headers={**AUTH, "Last-Event-ID": str(len(blocks) - 1)}).text
    assert tail.startswith(f"id: {len(blocks)}\n") and tail.count("id: ") == 1
    metrics = client.get(f"/v1/jobs/{job_id}/metrics", headers=AUTH).json()
    assert metrics["steps"][0]["metrics"]["reward_mean"] == 0.5
    assert metrics["evals"][0] == {"step": 1, "time": metrics["evals"][0]["time"], "dataset": "h", "score": 0.25,
                                   "metrics": {"score": 0.25, "num_prompts": 4.0}}
    png = client.get(f"/v1/jobs/{job_id}/plots/reward.png", headers=AUTH)
    assert png.headers["content-type"] == "image/png" and png.content.startswith(b"\x89PNG")
    prom = client.get("/metrics").text
    assert 'rlfleet_jobs{state="failed"}' in prom and "rlfleet_steps_total 1.0" in prom
    assert 'rlfleet_events_total{kind="eval"} 1.0' in prom
    schema = client.get("/v1/schema/job", headers=AUTH).json()
    assert schema["additionalProperties"] is False and "num_rollout" in schema["required"]


# ---- schemathesis ----------------------------------------------------------------------------------
@SCHEMA.parametrize()
@hypothesis.settings(max_examples=25, deadline=None, database=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
def test_openapi_contract_holds_for_generated_requests(case, api):
    """No generated request gets a 5xx or a response outside the schema, with or without the token.

    positive_data_acceptance is off: a body the OpenAPI schema accepts can still be an invalid job
    (a model folder that does not exist), which is rightly a 400 naming the field.
    """
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    _, _, _, job_id = api
    case.call_and_validate(headers=AUTH, excluded_checks=[positive_data_acceptance])
    if "job_id" in (case.path_parameters or {}):  # and once against a job that exists
        case.path_parameters = {**case.path_parameters, "job_id": job_id}
        case.call_and_validate(headers=AUTH, excluded_checks=[positive_data_acceptance])
