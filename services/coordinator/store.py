"""The coordinator's job store: job records, their ordered events, and what the events imply.

Every change to a job is an event appended in one transaction with the job-field updates it
causes; `step`, `eval` and `checkpoint` events are also projected into their own tables (step
metrics, eval results, checkpoints) so readers need not scan the log. Those tables hold the job's
current run: a job resumed from its checkpoint of step C runs the steps after C again, so the
resume drops their results there (`drop_after`) while the log keeps every event that happened.
`SqliteJobStore` keeps all of it in one SQLite file (WAL mode, one writer lock, a commit per
change), so a coordinator killed with SIGKILL finds every job and every event it had acknowledged.
`MemoryJobStore` has the same behaviour in dicts, for tests and throw-away coordinators. Nothing
here knows about gRPC, HTTP or the RL loop.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("rlfleet.coordinator")


class StoreError(RuntimeError):
    """The job store cannot be used (a damaged or foreign file)."""


class BadRow(ValueError):
    """A stored row that does not read as a job."""

PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = "pending", "running", "succeeded", "failed", "cancelled"
STATES = (PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED)
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)
# Fields of JobRecord an event may update (id, request_id, config and created_at never change).
MUTABLE_FIELDS = ("state", "step", "error", "summary", "output_dir", "cancel_requested", "updated_at")


@dataclass(frozen=True)
class JobRecord:
    id: str
    name: str
    config_yaml: str  # the resolved config (absolute paths), as the RL loop runs it
    base_dir: str
    output_dir: str
    num_steps: int
    created_at: float
    updated_at: float
    request_id: str = ""
    request_hash: str = ""  # what was submitted, so a reused request_id with other content is refused
    state: str = PENDING
    step: int = 0
    error: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    cancel_requested: bool = False


@dataclass(frozen=True)
class Event:
    seq: int  # 1, 2, ... per job
    job_id: str
    kind: str  # state | step | eval | weight_sync | log | sft | checkpoint
    time: float
    state: str  # the job's state once this event is applied
    step: int
    data: dict[str, Any]


@dataclass(frozen=True)
class StepMetrics:
    step: int
    time: float
    metrics: dict[str, Any]


@dataclass(frozen=True)
class EvalResult:
    step: int
    time: float
    dataset: str
    score: float | None
    metrics: dict[str, Any]


@dataclass(frozen=True)
class Checkpoint:
    step: int
    time: float
    path: str


class DuplicateRequestId(Exception):
    """insert_job was given a request_id another job already has; `existing` is that job."""

    def __init__(self, existing: JobRecord):
        super().__init__(existing.request_id)
        self.existing = existing


class JobStore(Protocol):
    def insert_job(self, job: JobRecord, event: tuple[str, dict]) -> tuple[JobRecord, Event]:
        """Store a new job and its first event; DuplicateRequestId when its request_id is taken."""

    def get_job(self, job_id: str) -> JobRecord | None: ...

    def find_request(self, request_id: str) -> JobRecord | None: ...

    def list_jobs(self, state: str | None, limit: int, before: int | None) -> tuple[list[JobRecord], int | None]:
        """Jobs newest first, starting below cursor `before`; returns the page and the next cursor."""

    def append_event(self, job_id: str, kind: str, time: float, step: int, data: dict,
                     updates: dict[str, Any] | None = None) -> tuple[JobRecord, Event]:
        """Apply `updates` to the job and append the event (carrying the new state) atomically."""

    def events(self, job_id: str, after_seq: int = 0, limit: int = 1000) -> list[Event]: ...

    def unfinished_jobs(self) -> list[JobRecord]:
        """Pending and running jobs, oldest first."""

    def step_metrics(self, job_id: str) -> list[StepMetrics]: ...

    def eval_results(self, job_id: str) -> list[EvalResult]: ...

    def checkpoints(self, job_id: str) -> list[Checkpoint]: ...

    def drop_after(self, job_id: str, step: int) -> None:
        """Forget the step metrics, eval results and checkpoints of steps after `step` (the log stays)."""

    def stats(self) -> dict[str, Any]:
        """{"jobs": {state: n}, "events": {kind: n}, "steps": n} for /metrics."""

    def close(self) -> None: ...


# ---- the projections every store derives from events -------------------------------------------
def clean(value: Any) -> Any:
    """JSON-safe data: non-finite floats become None (JSON has no NaN), tuples become lists."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return clean(value.item())
    return str(value)


def _projection(kind: str, time: float, step: int, data: dict) -> StepMetrics | EvalResult | Checkpoint | None:
    if kind == "step":
        return StepMetrics(step, time, data)
    if kind == "eval":
        metrics = {k: v for k, v in data.items() if k != "dataset"}
        score = data.get("score")
        return EvalResult(step, time, str(data.get("dataset") or "eval"),
                          float(score) if isinstance(score, int | float) else None, metrics)
    if kind == "checkpoint":
        return Checkpoint(step, time, str(data.get("path", "")))
    return None


def latest_per_step(items: list, key) -> list:
    """One item per key, the last one stored, in the order of their last appearance: a job
    resumed from a checkpoint runs the steps after it again, and the new results supersede."""
    last: dict = {}
    for item in items:
        last.pop(key(item), None)
        last[key(item)] = item
    return list(last.values())


# ---- in memory ----------------------------------------------------------------------------------
class MemoryJobStore:
    """The store in dicts: same semantics as SQLite, gone with the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRecord] = {}
        self._order: dict[str, int] = {}  # job id -> insertion number (the list cursor)
        self._events: dict[str, list[Event]] = {}
        self._projections: dict[str, list[Any]] = {}

    def insert_job(self, job, event):
        with self._lock:
            if job.request_id:
                for other in self._jobs.values():
                    if other.request_id == job.request_id:
                        raise DuplicateRequestId(other)
            if job.id in self._jobs:
                raise ValueError(f"job id {job.id!r} exists")
            self._jobs[job.id] = job
            self._order[job.id] = len(self._order) + 1
            self._events[job.id] = []
            self._projections[job.id] = []
        return self.append_event(job.id, event[0], job.created_at, 0, event[1])

    def get_job(self, job_id):
        with self._lock:
            return self._jobs.get(job_id)

    def find_request(self, request_id):
        with self._lock:
            return next((j for j in self._jobs.values() if request_id and j.request_id == request_id), None)

    def list_jobs(self, state, limit, before):
        with self._lock:
            rows = sorted(((n, j) for j, n in self._order.items()), reverse=True)
            rows = [(n, self._jobs[j]) for n, j in rows if (before is None or n < before)
                    and (state is None or self._jobs[j].state == state)]
        page = rows[:limit]
        return [j for _, j in page], (page[-1][0] if len(rows) > limit else None)

    def append_event(self, job_id, kind, time, step, data, updates=None):
        data = clean(data)
        with self._lock:
            job = replace(self._jobs[job_id], **{"updated_at": time, **(updates or {})})
            self._jobs[job_id] = job
            event = Event(len(self._events[job_id]) + 1, job_id, kind, time, job.state, step, data)
            self._events[job_id].append(event)
            projection = _projection(kind, time, step, data)
            if projection is not None:
                self._projections[job_id].append(projection)
        return job, event

    def events(self, job_id, after_seq=0, limit=1000):
        with self._lock:
            return list(self._events.get(job_id, [])[max(0, after_seq) : max(0, after_seq) + limit])

    def unfinished_jobs(self):
        with self._lock:
            jobs = sorted(self._jobs.values(), key=lambda j: self._order[j.id])
        return [j for j in jobs if j.state not in TERMINAL]

    def _of(self, job_id: str, cls: type) -> list:
        with self._lock:
            return [p for p in self._projections.get(job_id, []) if isinstance(p, cls)]

    def step_metrics(self, job_id):
        return latest_per_step(self._of(job_id, StepMetrics), lambda m: m.step)

    def eval_results(self, job_id):
        return latest_per_step(self._of(job_id, EvalResult), lambda e: (e.step, e.dataset))

    def checkpoints(self, job_id):
        return latest_per_step(self._of(job_id, Checkpoint), lambda c: c.step)

    def drop_after(self, job_id, step):
        with self._lock:
            self._projections[job_id] = [p for p in self._projections.get(job_id, []) if p.step <= step]

    def stats(self):
        with self._lock:
            jobs = {s: sum(j.state == s for j in self._jobs.values()) for s in STATES}
            kinds: dict[str, int] = {}
            for events in self._events.values():
                for e in events:
                    kinds[e.kind] = kinds.get(e.kind, 0) + 1
        return {"jobs": jobs, "events": kinds, "steps": kinds.get("step", 0)}

    def close(self):
        pass


# ---- SQLite -------------------------------------------------------------------------------------
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  rowid INTEGER PRIMARY KEY AUTOINCREMENT,
  id TEXT NOT NULL UNIQUE,
  name TEXT NOT NULL,
  state TEXT NOT NULL,
  config_yaml TEXT NOT NULL,
  base_dir TEXT NOT NULL,
  request_id TEXT UNIQUE,              -- NULL when none was given (UNIQUE allows many NULLs)
  request_hash TEXT NOT NULL,
  step INTEGER NOT NULL,
  num_steps INTEGER NOT NULL,
  error TEXT NOT NULL,
  summary_json TEXT NOT NULL,
  output_dir TEXT NOT NULL,
  cancel_requested INTEGER NOT NULL,
  created_at REAL NOT NULL,
  updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, rowid);
CREATE TABLE IF NOT EXISTS events (
  job_id TEXT NOT NULL REFERENCES jobs(id),
  seq INTEGER NOT NULL,
  kind TEXT NOT NULL,
  time REAL NOT NULL,
  state TEXT NOT NULL,
  step INTEGER NOT NULL,
  data_json TEXT NOT NULL,
  PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS metrics (
  job_id TEXT NOT NULL REFERENCES jobs(id), seq INTEGER NOT NULL, step INTEGER NOT NULL,
  time REAL NOT NULL, metrics_json TEXT NOT NULL, PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS eval_results (
  job_id TEXT NOT NULL REFERENCES jobs(id), seq INTEGER NOT NULL, step INTEGER NOT NULL,
  time REAL NOT NULL, dataset TEXT NOT NULL, score REAL, metrics_json TEXT NOT NULL,
  PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS checkpoints (
  job_id TEXT NOT NULL REFERENCES jobs(id), seq INTEGER NOT NULL, step INTEGER NOT NULL,
  time REAL NOT NULL, path TEXT NOT NULL, PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
"""
_JOB_COLUMNS = ("rowid, id, name, state, config_yaml, base_dir, request_id, request_hash, step, num_steps, error, "
                "summary_json, output_dir, cancel_requested, created_at, updated_at")
SCHEMA_VERSION = 1


class SqliteJobStore:
    """The store in one SQLite file, through one connection guarded by one lock.

    One connection keeps it simple and leak-free (job threads come and go); the coordinator's
    reads and writes are small, so serialising them costs nothing measurable.
    """

    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).expanduser().absolute().parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE ... COMMIT) below.
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode survives a killed process (only a power cut can lose the last commits).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"job store {self.path} has schema version {version}; this rlfleet knows "
                               f"{SCHEMA_VERSION} (a newer rlfleet wrote it)")
        problems = [row[0] for row in self._db.execute("PRAGMA quick_check(5)").fetchall()]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError(f"integrity check failed ({'; '.join(problems)})")
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _write(self, fn):
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return result

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---- jobs ------------------------------------------------------------------------------------
    def insert_job(self, job, event):
        def insert(conn):
            if job.request_id:
                row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE request_id = ?", (job.request_id,)).fetchone()
                if row is not None:
                    raise DuplicateRequestId(_job(row))
            conn.execute(
                "INSERT INTO jobs (id, name, state, config_yaml, base_dir, request_id, request_hash, step, num_steps,"
                " error, summary_json, output_dir, cancel_requested, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (job.id, job.name, job.state, job.config_yaml, job.base_dir, job.request_id or None, job.request_hash,
                 job.step, job.num_steps, job.error, json.dumps(clean(job.summary)), job.output_dir,
                 int(job.cancel_requested), job.created_at, job.updated_at),
            )
            return self._append(conn, job.id, event[0], job.created_at, 0, event[1], None)

        return self._write(insert)

    def get_job(self, job_id):
        rows = self._read(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,))
        return _job(rows[0]) if rows else None

    def find_request(self, request_id):
        if not request_id:
            return None
        rows = self._read(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE request_id = ?", (request_id,))
        return _job(rows[0]) if rows else None

    def list_jobs(self, state, limit, before):
        where, args = [], []
        if state is not None:
            where.append("state = ?")
            args.append(state)
        if before is not None:
            where.append("rowid < ?")
            args.append(before)
        sql = f"SELECT {_JOB_COLUMNS} FROM jobs {'WHERE ' + ' AND '.join(where) if where else ''} ORDER BY rowid DESC LIMIT ?"
        rows = self._read(sql, (*args, limit + 1))
        page = rows[:limit]
        return _jobs(page), (page[-1][0] if len(rows) > limit else None)

    def unfinished_jobs(self):
        rows = self._read(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE state NOT IN (?, ?, ?) ORDER BY rowid", TERMINAL)
        return _jobs(rows)

    # ---- events ----------------------------------------------------------------------------------
    def append_event(self, job_id, kind, time, step, data, updates=None):
        return self._write(lambda conn: self._append(conn, job_id, kind, time, step, data, updates))

    def _append(self, conn, job_id, kind, time, step, data, updates) -> tuple[JobRecord, Event]:
        updates = {"updated_at": time, **(updates or {})}
        unknown = set(updates) - set(MUTABLE_FIELDS)
        assert not unknown, f"not updatable: {unknown}"
        columns = {("summary_json" if k == "summary" else k): v for k, v in updates.items()}
        if "summary_json" in columns:
            columns["summary_json"] = json.dumps(clean(columns["summary_json"]))
        if "cancel_requested" in columns:
            columns["cancel_requested"] = int(columns["cancel_requested"])
        conn.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in columns)} WHERE id = ?", (*columns.values(), job_id))
        row = conn.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise KeyError(job_id)
        job = _job(row)
        seq = conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM events WHERE job_id = ?", (job_id,)).fetchone()[0]
        data = clean(data)
        conn.execute("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?)",
                     (job_id, seq, kind, time, job.state, step, json.dumps(data)))
        projection = _projection(kind, time, step, data)
        if isinstance(projection, StepMetrics):
            conn.execute("INSERT INTO metrics VALUES (?, ?, ?, ?, ?)", (job_id, seq, step, time, json.dumps(data)))
        elif isinstance(projection, EvalResult):
            conn.execute("INSERT INTO eval_results VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (job_id, seq, step, time, projection.dataset, projection.score,
                          json.dumps(projection.metrics)))
        elif isinstance(projection, Checkpoint):
            conn.execute("INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?)", (job_id, seq, step, time, projection.path))
        return job, Event(seq, job_id, kind, time, job.state, step, data)

    def events(self, job_id, after_seq=0, limit=1000):
        rows = self._read(
            "SELECT seq, kind, time, state, step, data_json FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after_seq, limit),
        )
        return [Event(seq, job_id, kind, t, state, step, json.loads(data)) for seq, kind, t, state, step, data in rows]

    def step_metrics(self, job_id):
        rows = self._read(
            "SELECT step, time, metrics_json FROM metrics WHERE job_id = ? ORDER BY seq", (job_id,)
        )
        return latest_per_step([StepMetrics(step, t, json.loads(m)) for step, t, m in rows], lambda m: m.step)

    def eval_results(self, job_id):
        rows = self._read(
            "SELECT step, time, dataset, score, metrics_json FROM eval_results WHERE job_id = ? ORDER BY seq", (job_id,)
        )
        results = [EvalResult(step, t, dataset, score, json.loads(m)) for step, t, dataset, score, m in rows]
        return latest_per_step(results, lambda e: (e.step, e.dataset))

    def checkpoints(self, job_id):
        rows = self._read(
            "SELECT step, time, path FROM checkpoints WHERE job_id = ? ORDER BY seq", (job_id,)
        )
        return latest_per_step([Checkpoint(step, t, path) for step, t, path in rows], lambda c: c.step)

    def drop_after(self, job_id, step):
        def drop(conn):
            for table in ("metrics", "eval_results", "checkpoints"):
                conn.execute(f"DELETE FROM {table} WHERE job_id = ? AND step > ?", (job_id, step))

        self._write(drop)

    def stats(self):
        jobs = {s: 0 for s in STATES}
        jobs.update(dict(self._read("SELECT state, COUNT(*) FROM jobs GROUP BY state")))
        kinds = dict(self._read("SELECT kind, COUNT(*) FROM events GROUP BY kind"))
        return {"jobs": jobs, "events": kinds, "steps": kinds.get("step", 0)}

    def close(self):
        with self._lock:
            self._db.close()


def _job(row: tuple) -> JobRecord:
    (_, id_, name, state, config_yaml, base_dir, request_id, request_hash, step, num_steps, error, summary_json,
     output_dir, cancel_requested, created_at, updated_at) = row
    if not isinstance(id_, str) or state not in STATES or not isinstance(config_yaml, str):
        raise BadRow(f"job row {row[0]} ({id_!r}): malformed (state {state!r})")
    try:
        summary = json.loads(summary_json or "{}")
    except ValueError:
        summary = {"unreadable": "the stored summary is not valid JSON"}
    return JobRecord(
        id=id_, name=str(name), state=state, config_yaml=config_yaml, base_dir=str(base_dir), request_id=request_id or "",
        request_hash=str(request_hash or ""), step=int(step or 0), num_steps=int(num_steps or 0), error=str(error or ""),
        summary=summary, output_dir=str(output_dir or ""), cancel_requested=bool(cancel_requested),
        created_at=float(created_at or 0), updated_at=float(updated_at or 0),
    )


def _jobs(rows: list[tuple]) -> list[JobRecord]:
    """The rows that read as jobs; one malformed row is reported and skipped, never takes the rest down."""
    jobs = []
    for row in rows:
        try:
            jobs.append(_job(row))
        except (BadRow, TypeError, ValueError) as e:
            log.error("job store: skipping a row: %s", e)
    return jobs


def open_store(db: str | None) -> JobStore:
    """`--db PATH`: SQLite at PATH; None or "memory" keeps jobs in memory only. A file that is not
    a sound SQLite database is StoreError with one line saying what to do."""
    if db is None or db == "memory":
        return MemoryJobStore()
    try:
        return SqliteJobStore(db)
    except sqlite3.DatabaseError as e:
        reason = " ".join(str(e).split())  # one line
        raise StoreError(f"job store {db}: {reason}: the file is damaged; move it aside to start with an empty store "
                         "(or restore a backup)") from e
