"""The job store (SQLite and memory alike) and the JobManager over it: events as the source of
truth, idempotent creates, paging, the queue, cancel, and the restart policy."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from services.coordinator.config import ConfigError
from services.coordinator.jobs import (
    RESTART_REASON,
    JobFinished,
    JobManager,
    JobNotFound,
    RequestConflict,
)
from services.coordinator.store import DuplicateRequestId, JobRecord, MemoryJobStore, SqliteJobStore


@pytest.fixture(params=["sqlite", "memory"])
def store(request, tmp_path):
    s = SqliteJobStore(tmp_path / "jobs.db") if request.param == "sqlite" else MemoryJobStore()
    yield s
    s.close()


def _record(job_id: str, request_id: str = "", t: float = 1.0) -> JobRecord:
    return JobRecord(id=job_id, name=f"n-{job_id}", config_yaml="name: x\n", base_dir="/", output_dir="/out",
                     num_steps=10, created_at=t, updated_at=t, request_id=request_id, request_hash="h")


def test_events_are_numbered_per_job_and_update_the_job_atomically(store):
    store.insert_job(_record("a"), ("state", {}))
    store.insert_job(_record("b"), ("state", {}))
    job, event = store.append_event("a", "state", 2.0, 0, {}, {"state": "running"})
    assert job.state == event.state == "running" and event.seq == 2 and job.updated_at == 2.0
    store.append_event("a", "step", 3.0, 1, {"reward_mean": 0.5, "nan": float("nan")}, {"step": 1})
    store.append_event("a", "eval", 3.5, 1, {"dataset": "held", "score": 0.25, "num_prompts": 8})
    store.append_event("a", "checkpoint", 3.6, 1, {"path": "/ckpt/1"})
    job, _ = store.append_event("a", "state", 4.0, 1, {"error": "boom"}, {"state": "failed", "error": "boom",
                                                                         "summary": {"x": 1}})
    assert (job.state, job.step, job.error, job.summary) == ("failed", 1, "boom", {"x": 1})
    assert [e.seq for e in store.events("a")] == [1, 2, 3, 4, 5, 6]
    assert [e.kind for e in store.events("a", after_seq=4)] == ["checkpoint", "state"]
    assert [e.seq for e in store.events("b")] == [1]
    assert store.events("a")[2].data == {"reward_mean": 0.5, "nan": None}  # JSON has no NaN
    assert [(m.step, m.metrics["reward_mean"]) for m in store.step_metrics("a")] == [(1, 0.5)]
    (ev,) = store.eval_results("a")
    assert (ev.dataset, ev.score, ev.metrics["num_prompts"]) == ("held", 0.25, 8)
    assert [c.path for c in store.checkpoints("a")] == ["/ckpt/1"]
    stats = store.stats()
    assert stats["jobs"]["failed"] == 1 and stats["jobs"]["pending"] == 1
    assert stats["events"]["state"] == 4 and stats["steps"] == 1


def test_a_resume_drops_the_results_after_its_checkpoint(store):
    """Steps 1-5 ran (evals at 0 and 4, checkpoints at 2 and 4), then the job resumed from step 2
    and ran step 3 again before it stopped: the stored results are those of steps 0-2 and the new 3,
    none of the abandoned run after step 2; the log keeps every event."""
    store.insert_job(_record("a"), ("state", {}))
    t = iter(range(10, 100))

    def step(n: int, reward: float) -> None:
        store.append_event("a", "step", float(next(t)), n, {"reward_mean": reward}, {"step": n})

    def evals(n: int, score: float) -> None:
        for dataset in ("x", "y"):
            store.append_event("a", "eval", float(next(t)), n, {"dataset": dataset, "score": score})

    evals(0, 0.0)
    for n in range(1, 6):
        step(n, 0.0)
        if n % 2 == 0:
            store.append_event("a", "checkpoint", float(next(t)), n, {"path": f"/ckpt/{n}"})
    evals(4, 0.4)
    store.drop_after("a", 2)
    step(3, 1.0)
    assert [(m.step, m.metrics["reward_mean"]) for m in store.step_metrics("a")] == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert [(e.step, e.dataset) for e in store.eval_results("a")] == [(0, "x"), (0, "y")]
    assert [c.path for c in store.checkpoints("a")] == ["/ckpt/2"]
    assert [e.step for e in store.events("a") if e.kind == "step"] == [1, 2, 3, 4, 5, 3]


def test_request_ids_are_unique_and_pages_go_newest_first(store):
    store.insert_job(_record("a", request_id="r1"), ("state", {}))
    with pytest.raises(DuplicateRequestId) as err:
        store.insert_job(_record("z", request_id="r1"), ("state", {}))
    assert err.value.existing.id == "a" and store.get_job("z") is None
    for name in "bcde":
        store.insert_job(_record(name), ("state", {}))
    assert store.find_request("r1").id == "a" and store.find_request("nope") is None
    seen, cursor = [], None
    while True:
        page, cursor = store.list_jobs(None, 2, cursor)
        seen += [j.id for j in page]
        if cursor is None:
            break
    assert seen == ["e", "d", "c", "b", "a"]
    store.append_event("c", "state", 2.0, 0, {}, {"state": "running"})
    assert [j.id for j in store.list_jobs("running", 10, None)[0]] == ["c"]
    assert [j.id for j in store.unfinished_jobs()] == ["a", "b", "c", "d", "e"]


def test_sqlite_store_keeps_everything_across_reopen(tmp_path):
    path = tmp_path / "jobs.db"
    first = SqliteJobStore(path)
    first.insert_job(_record("a", request_id="r"), ("state", {}))
    first.append_event("a", "step", 2.0, 1, {"reward_mean": 1.0}, {"step": 1, "state": "running"})
    # no close(): as after SIGKILL, only what was committed counts
    second = SqliteJobStore(path)
    job = second.get_job("a")
    assert (job.state, job.step, job.request_id) == ("running", 1, "r")
    assert [e.kind for e in second.events("a")] == ["state", "step"]
    assert second.step_metrics("a")[0].metrics == {"reward_mean": 1.0}
    first.close()
    second.close()


# ---- the manager -----------------------------------------------------------------------------------
def _eval_job(model_dir, eval_file, name="ev") -> str:
    return f"name: {name}\nmodel: {model_dir}\nnum_rollout: 0\neval: {{datasets: [{{name: h, path: {eval_file}}}]}}\n"


class _BlockingFleet:
    """A fleet factory that holds each job in setup until released, then fails it."""

    def __init__(self):
        self.release = threading.Event()
        self.started: list[str] = []

    def __call__(self, job):
        self.started.append(job.name)
        self.release.wait(10)
        raise RuntimeError("no workers in this test")


def _wait_state(manager, job_id, states, timeout=10.0):
    deadline = time.monotonic() + timeout
    while manager.get(job_id).state not in states:
        assert time.monotonic() < deadline, manager.get(job_id)
        time.sleep(0.01)
    return manager.get(job_id)


def test_create_is_idempotent_per_request_id_and_refuses_reuse(tmp_path, tiny_model_dir, task_files):
    fleet = _BlockingFleet()
    manager = JobManager(fleet, runs_dir=tmp_path, store=SqliteJobStore(tmp_path / "db"))
    text = _eval_job(tiny_model_dir, task_files[1])
    job, created = manager.submit(text, str(tmp_path), "req-1")
    again, created_again = manager.submit(text, str(tmp_path), "req-1")
    assert created and not created_again and again.id == job.id
    with pytest.raises(RequestConflict, match="req-1"):
        manager.submit(text.replace("name: ev", "name: other"), str(tmp_path), "req-1")
    with pytest.raises(ConfigError, match="modle"):
        manager.submit(text + "modle: 1\n", str(tmp_path))
    with pytest.raises(ConfigError, match="request_id"):
        manager.submit(text, str(tmp_path), "r" * 200)
    with pytest.raises(JobNotFound):
        manager.get("nope")
    fleet.release.set()
    assert _wait_state(manager, job.id, ("failed",)).error == "RuntimeError: no workers in this test"
    with pytest.raises(JobFinished):
        manager.cancel(job.id, strict=True)
    assert manager.cancel(job.id).state == "failed"  # lenient form: what `--job` callers use


def test_jobs_queue_one_at_a_time_and_cancel_works_in_each_state(tmp_path, tiny_model_dir, task_files):
    fleet = _BlockingFleet()
    manager = JobManager(fleet, runs_dir=tmp_path)
    first = manager.create(_eval_job(tiny_model_dir, task_files[1], "first"), str(tmp_path))
    second = manager.create(_eval_job(tiny_model_dir, task_files[1], "second"), str(tmp_path))
    third = manager.create(_eval_job(tiny_model_dir, task_files[1], "third"), str(tmp_path))
    _wait_state(manager, first.id, ("running",))
    deadline = time.monotonic() + 10
    while not fleet.started:  # the job thread reaches the fleet just after storing "running"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert manager.get(second.id).state == "pending" and fleet.started == ["first"]
    cancelled = manager.cancel(second.id)
    assert (cancelled.state, cancelled.error) == ("cancelled", "cancelled before it started")
    running = manager.cancel(first.id)
    assert running.state == "running" and running.cancel_requested
    fleet.release.set()
    assert _wait_state(manager, first.id, ("failed", "cancelled")).cancel_requested is False
    _wait_state(manager, third.id, ("failed",))
    assert fleet.started == ["first", "third"]
    kinds = [(e.kind, e.state) for e in manager.watch(second.id)]
    assert kinds == [("state", "pending"), ("state", "cancelled")]
    page, token = manager.list_page(None, 2)
    assert [j.name for j in page] == ["third", "second"] and token
    rest, last = manager.list_page(None, 2, token)
    assert [j.name for j in rest] == ["first"] and last == ""
    with pytest.raises(ValueError, match="page_token"):
        manager.list_page(None, 2, "garbage")


def test_restart_fails_running_jobs_and_requeues_pending_ones(tmp_path, tiny_model_dir, task_files):
    path = tmp_path / "jobs.db"
    fleet = _BlockingFleet()
    before = JobManager(fleet, runs_dir=tmp_path, store=SqliteJobStore(path))
    running = before.create(_eval_job(tiny_model_dir, task_files[1], "running"), str(tmp_path), "rid")
    pending = before.create(_eval_job(tiny_model_dir, task_files[1], "pending"), str(tmp_path))
    _wait_state(before, running.id, ("running",))
    events_before = [(e.seq, e.kind, e.state) for e in before.watch(running.id, follow=False)]
    # The "killed" coordinator's thread stays blocked; a new manager opens the same file.
    after_fleet = _BlockingFleet()
    after_fleet.release.set()
    after = JobManager(after_fleet, runs_dir=tmp_path, store=SqliteJobStore(path))
    job = after.get(running.id)
    assert (job.state, job.error) == ("failed", RESTART_REASON)
    events = [(e.seq, e.kind, e.state) for e in after.watch(running.id)]
    assert events[: len(events_before)] == events_before and events[-1] == (len(events_before) + 1, "state", "failed")
    assert after.submit(_eval_job(tiny_model_dir, task_files[1], "running"), str(tmp_path), "rid") == (job, False)
    _wait_state(after, pending.id, ("failed",))  # queued again, and ran (into this test's missing workers)
    assert after_fleet.started == ["pending"]
    messages = [e.data.get("message") for e in after.watch(pending.id) if e.kind == "log"]
    assert "coordinator restarted; the job is still queued" in messages
    before.close()  # let the stand-in for the killed process end quietly
    fleet.release.set()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad-page"])
def test_a_damaged_store_file_stops_serve_with_one_clear_line(tmp_path, damage):
    import subprocess
    import sys

    from services.coordinator.store import SqliteJobStore

    db = tmp_path / "jobs.db"
    store = SqliteJobStore(db)
    for i in range(200):  # a few pages of rows
        store.insert_job(replace(_record(f"job{i:04d}"), config_yaml="x" * 500), ("state", {}))
    store.close()
    data = bytearray(db.read_bytes())
    if damage == "garbage":
        data[:100] = b"\x07" * 100  # the header
    elif damage == "truncated":
        data = data[: len(data) // 3]
    else:
        page = 4096
        data[3 * page : 3 * page + 200] = b"\xff" * 200  # one interior page
    db.write_bytes(bytes(data))
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"jobs.db{suffix}").unlink(missing_ok=True)
    result = subprocess.run([sys.executable, "-m", "services.cli", "serve", "coordinator", "--db", str(db)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"rlfleet: job store {db}:") and "move it aside" in lines[-1]
    assert "Traceback" not in result.stderr


def test_one_malformed_row_is_skipped_and_the_rest_load(tmp_path):
    import sqlite3

    from services.coordinator.store import SqliteJobStore

    db = tmp_path / "jobs.db"
    store = SqliteJobStore(db)
    for name in ("a", "b", "c"):
        store.insert_job(_record(name), ("state", {}))
    store.close()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE jobs SET state = 'exploded', summary_json = '{not json' WHERE id = 'b'")
        conn.execute("UPDATE jobs SET summary_json = '{not json' WHERE id = 'c'")
    store = SqliteJobStore(db)
    jobs, _ = store.list_jobs(None, 10, None)
    assert sorted(j.id for j in jobs) == ["a", "c"]  # b is skipped; c's unreadable summary is marked, not fatal
    assert next(j for j in jobs if j.id == "c").summary == {"unreadable": "the stored summary is not valid JSON"}
    assert [j.id for j in store.unfinished_jobs()] == ["a", "c"]
    store.close()


def test_a_page_damaged_while_serving_is_a_503_not_a_500(tmp_path):
    import sqlite3

    from fastapi.testclient import TestClient

    from services.coordinator.rest import create_app

    manager = JobManager(lambda job: None, runs_dir=tmp_path, store=SqliteJobStore(tmp_path / "jobs.db"))
    client = TestClient(create_app(manager))
    assert client.get("/v1/jobs").status_code == 200

    def damaged(*args, **kwargs):
        raise sqlite3.DatabaseError("database disk image is malformed")

    manager.store.list_jobs = damaged
    reply = client.get("/v1/jobs")
    assert reply.status_code == 503 and reply.json()["detail"] == "job store: database disk image is malformed"
    assert client.get("/healthz").status_code == 200  # the service itself answers on
    manager.close()
