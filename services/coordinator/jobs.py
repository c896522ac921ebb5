"""Jobs as resources: create, get, list, cancel and watch, each job running its RL loop in a thread.

The manager keeps every job's record and its ordered event log; watchers replay the log from a
sequence number and then follow it live. Files a person wants to look at (metrics JSON lines, the
summary, the reward-curve PNG) are written to the job's output directory as events arrive.
"""

from __future__ import annotations

import json
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import yaml

from services import rpc
from services.coordinator.config import JobConfig, parse_job, to_dict
from services.coordinator.loop import JobCancelled, RLLoop
from services.coordinator.metrics import MetricsWriter, plot_rewards

log = rpc.get_logger("coordinator")

PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = "pending", "running", "succeeded", "failed", "cancelled"
TERMINAL = (SUCCEEDED, FAILED, CANCELLED)


class JobNotFound(KeyError):
    def __str__(self) -> str:
        return f"job {self.args[0]!r} not found"


@dataclass
class Event:
    seq: int
    job_id: str
    kind: str
    time: float
    state: str
    step: int
    data: dict


@dataclass
class JobRecord:
    id: str
    name: str
    config: JobConfig
    config_yaml: str
    output_dir: Path
    request_id: str = ""
    state: str = PENDING
    step: int = 0
    error: str = ""
    summary: dict = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    events: list[Event] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def num_steps(self) -> int:
        return self.config.num_rollout


class JobManager:
    def __init__(self, make_fleet: Callable[[JobConfig], object], runs_dir: Path = Path("runs")):
        self._make_fleet = make_fleet
        self._runs_dir = runs_dir
        self._jobs: dict[str, JobRecord] = {}
        self._by_request: dict[str, str] = {}
        self._cond = threading.Condition()

    def create(self, config_yaml: str, base_dir: str, request_id: str = "") -> JobRecord:
        with self._cond:
            if request_id and request_id in self._by_request:
                return self._jobs[self._by_request[request_id]]
        config = parse_job(config_yaml, Path(base_dir or "."))  # ConfigError names the field
        job_id = uuid.uuid4().hex[:12]
        output_dir = Path(config.output_dir) if config.output_dir else self._runs_dir / f"{config.name}-{job_id}"
        record = JobRecord(
            id=job_id,
            name=config.name,
            config=config,
            config_yaml=yaml.safe_dump(to_dict(config), sort_keys=False),
            output_dir=output_dir,
            request_id=request_id,
        )
        with self._cond:
            if request_id and request_id in self._by_request:  # lost a race with an identical retry
                return self._jobs[self._by_request[request_id]]
            self._jobs[job_id] = record
            if request_id:
                self._by_request[request_id] = job_id
            self._append(record, "state", 0, {})
        threading.Thread(target=self._run, args=(record,), name=f"job-{job_id}", daemon=True).start()
        return record

    def get(self, job_id: str) -> JobRecord:
        with self._cond:
            if job_id not in self._jobs:
                raise JobNotFound(job_id)
            return self._jobs[job_id]

    def list(self, state: str | None = None) -> list[JobRecord]:
        with self._cond:
            jobs = sorted(self._jobs.values(), key=lambda j: (j.created_at, j.id))
        return [j for j in jobs if state is None or j.state == state]

    def cancel(self, job_id: str) -> JobRecord:
        record = self.get(job_id)
        record.cancel.set()
        with self._cond:
            if record.state == PENDING:
                self._set_state(record, CANCELLED, error="cancelled before it started")
        return record

    def watch(self, job_id: str, after_seq: int = 0, stop: threading.Event | None = None) -> Iterator[Event]:
        """Events after `after_seq`, then live ones until the job ends (or `stop` is set)."""
        record = self.get(job_id)
        seq = after_seq
        while True:
            with self._cond:
                while len(record.events) <= seq and record.state not in TERMINAL:
                    if stop is not None and stop.is_set():
                        return
                    self._cond.wait(timeout=0.5)
                new = record.events[seq:]
                done = record.state in TERMINAL
            yield from new
            seq += len(new)
            if done and seq >= len(record.events):
                return

    # ---- running -----------------------------------------------------------------------------
    def _run(self, record: JobRecord) -> None:
        if record.cancel.is_set():
            return
        with self._cond:
            self._set_state(record, RUNNING)
        record.output_dir.mkdir(parents=True, exist_ok=True)
        writer = MetricsWriter(record.output_dir)
        (record.output_dir / "job.yaml").write_text(record.config_yaml)

        def emit(kind: str, step: int, data: dict) -> None:
            if kind == "step":
                writer.write_step(step, data)
                record.step = step
            elif kind == "eval":
                writer.write_eval(step, data)
            with self._cond:
                self._append(record, kind, step, data)

        loop = None
        try:
            loop = RLLoop(record.config, self._make_fleet(record.config), emit, record.cancel)
            summary = loop.run()
            summary["output_dir"] = str(record.output_dir)
            summary["plot"] = str(plot_rewards(record.output_dir))
            (record.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            record.summary = summary
            state, error = SUCCEEDED, ""
        except JobCancelled:
            state, error = CANCELLED, "cancelled"
        except Exception as e:  # the job fails, the coordinator lives on
            log.error("job %s failed: %s\n%s", record.id, e, traceback.format_exc())
            state, error = FAILED, f"{type(e).__name__}: {e}"
        finally:
            if loop is not None:
                loop.close()
        with self._cond:
            self._set_state(record, state, error=error)

    def _set_state(self, record: JobRecord, state: str, error: str = "") -> None:
        record.state, record.error = state, error
        self._append(record, "state", record.step, {"error": error} if error else {})

    def _append(self, record: JobRecord, kind: str, step: int, data: dict) -> None:
        record.updated_at = time.time()
        record.events.append(Event(len(record.events) + 1, record.id, kind, record.updated_at, record.state, step, data))
        self._cond.notify_all()
