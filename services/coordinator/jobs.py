"""Jobs as resources: create, get, list, cancel and watch; a queue runs each job's RL loop in a thread.

Every job and every event is persisted through a `JobStore` (SQLite for `serve coordinator`,
memory for tests) before anyone sees it, so watchers replay the stored log from a sequence
number and then follow it live, and a restarted coordinator finds every job it had accepted.
At most `max_running` jobs run at once (one by default: a static fleet of workers serves one job
at a time); the rest wait `pending` in submission order. Files a person wants to look at (metrics
JSON lines, the summary, the reward-curve PNG) are still written to the job's output directory.

Restart policy: a job that was `running` when the coordinator died or stopped resumes from its
last checkpoint when it has one (the trainer loads weights, optimizer and scheduler; the loop
replays the data order and sampling seeds up to that step, so the steps after it come out as
they would have); without a checkpoint it is marked `failed` with RESTART_REASON. A `pending`
job never started, so it is queued again and runs. A job that loses a trainer while the
coordinator lives (its process killed, its pod drained: a trainer call fails UNAVAILABLE or
DEADLINE_EXCEEDED, or finds the trainer unconfigured) resumes the same way: the coordinator makes
its fleet anew (discovery says where the trainers are now), waits up to `trainer_wait_s` until
every trainer answers, and runs on from the last checkpoint, at most `trainer_restarts` times
per job (`serve coordinator --trainer-restarts`; 0 turns this off). Without a checkpoint, or with
no restart left, the job fails with an error saying so. Either way the steps after the checkpoint
run again: their metric lines and stored results are dropped first, so each step keeps one.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import itertools
import json
import tempfile
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import yaml

from services import rpc
from services.coordinator.config import ConfigError, JobConfig, parse_job, to_dict
from services.coordinator.clients import PeerError
from services.coordinator.fleet import EnginesDiscovered
from services.coordinator.loop import Fleet, JobCancelled, Resume, RLLoop
from services.coordinator.metrics import MetricsWriter, plot_rewards
from services.coordinator.rewards import RewardError, check_reward_modules
from services.coordinator.store import (
    CANCELLED,
    FAILED,
    PENDING,
    RUNNING,
    STATES,
    SUCCEEDED,
    TERMINAL,
    Checkpoint,
    DuplicateRequestId,
    Event,
    JobRecord,
    JobStore,
    MemoryJobStore,
)
from services.coordinator.tracking import NullTracker, Tracker, build_tracker
from services.coordinator.trainer_recovery import (
    TrainerLost, close_clients, gone, lost_trainer, wait_for_trainers,
)

__all__ = [
    "CANCELLED", "FAILED", "PENDING", "RUNNING", "STATES", "SUCCEEDED", "TERMINAL", "Event", "JobRecord",
    "JobManager", "JobNotFound", "RequestConflict", "JobFinished", "RESTART_REASON", "SHUTDOWN_REASON",
]

log = rpc.get_logger("coordinator")

RESTART_REASON = "coordinator restarted while the job was running (no checkpoint to resume from)"
SHUTDOWN_REASON = "coordinator stopped while the job was running (no checkpoint to resume from)"
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 50
MAX_REQUEST_ID_CHARS = 128
MAX_CONFIG_CHARS = 1 << 20


class JobNotFound(KeyError):
    def __str__(self) -> str:
        return f"job {self.args[0]!r} not found"


class RequestConflict(Exception):
    """A request_id was reused for a different job config (HTTP 409, gRPC ALREADY_EXISTS)."""


class JobFinished(Exception):
    """The job already ended, so it cannot be cancelled (HTTP 409, gRPC FAILED_PRECONDITION)."""


@dataclass
class _Live:
    """What only the running process knows about a job: its parsed config and cancel flag."""

    config: JobConfig
    cancel: threading.Event = field(default_factory=threading.Event)
    done: bool = False  # a terminal state is stored; later events from the loop are dropped
    resume: Checkpoint | None = None  # run on from this checkpoint instead of from the start


class JobManager:
    def __init__(
        self,
        make_fleet: Callable[[JobConfig], object],
        runs_dir: Path = Path("runs"),
        store: JobStore | None = None,
        max_running: int = 1,
        allowed_reward_modules: tuple[str, ...] = (),
        trainer_restarts: int = 3,
        trainer_wait_s: float = 600.0,
    ):
        if max_running < 1:
            raise ValueError(f"max_running: must be >= 1, got {max_running}")
        if trainer_restarts < 0:
            raise ValueError(f"trainer_restarts: must be >= 0, got {trainer_restarts}")
        if not trainer_wait_s >= 0:
            raise ValueError(f"trainer_wait_s: must be >= 0, got {trainer_wait_s}")
        self._make_fleet = make_fleet
        self._runs_dir = Path(runs_dir)
        self._allowed_reward_modules = tuple(allowed_reward_modules)  # python rewards a job may import
        self.store: JobStore = store if store is not None else MemoryJobStore()
        self._max_running = max_running
        # How often one job may restart from its checkpoint after losing a trainer, and how long
        # it waits each time for every trainer to answer again.
        self._trainer_restarts, self._trainer_wait_s = trainer_restarts, trainer_wait_s
        self._live: dict[str, _Live] = {}
        self._queue: deque[str] = deque()
        self._running: set[str] = set()
        self._closed = False
        # Guards the queue and every store write, and wakes watchers on each new event.
        self._cond = threading.Condition()
        self._recover()

    # ---- resources -------------------------------------------------------------------------------
    def create(self, config_yaml: str, base_dir: str, request_id: str = "") -> JobRecord:
        return self.submit(config_yaml, base_dir, request_id)[0]

    def submit(self, config_yaml: str, base_dir: str, request_id: str = "") -> tuple[JobRecord, bool]:
        """Validate, store and queue a job; returns (job, created). A known request_id returns its job."""
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise ConfigError(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
        if "\0" in base_dir:
            raise ConfigError("base_dir: contains a NUL character")
        if len(config_yaml) > MAX_CONFIG_CHARS:
            raise ConfigError(f"config_yaml: at most {MAX_CONFIG_CHARS} characters, got {len(config_yaml)}")
        if not config_yaml.strip():
            raise ConfigError("config_yaml: empty job config")
        request_hash = hashlib.sha256(json.dumps([config_yaml, base_dir]).encode()).hexdigest()
        existing = self.store.find_request(request_id) if request_id else None
        if existing is not None:
            return self._same_request(existing, request_hash), False
        base = Path(base_dir or ".").absolute()
        try:
            config = parse_job(config_yaml, base)  # ConfigError names the field
        except RecursionError as e:
            raise ConfigError("job config: nested too deeply") from e
        _check_text(request_id=request_id, base_dir=base_dir, config=to_dict(config))
        try:
            check_reward_modules(config.rewards, self._allowed_reward_modules)
        except RewardError as e:
            raise ConfigError(str(e)) from e
        job_id = uuid.uuid4().hex[:12]
        output_dir = Path(config.output_dir) if config.output_dir else self._runs_dir / f"{config.name}-{job_id}"
        # The job's config says where it writes (checkpoints default to <output_dir>/checkpoints).
        config = dataclasses.replace(config, output_dir=output_dir.absolute())
        now = time.time()
        record = JobRecord(
            id=job_id, name=config.name, config_yaml=yaml.safe_dump(to_dict(config), sort_keys=False),
            base_dir=str(base), output_dir=str(output_dir.absolute()), num_steps=config.num_rollout,
            created_at=now, updated_at=now, request_id=request_id, request_hash=request_hash,
        )
        with self._cond:
            try:
                record, _ = self.store.insert_job(record, ("state", {}))
            except DuplicateRequestId as e:  # lost a race with an identical retry
                return self._same_request(e.existing, request_hash), False
            self._live[job_id] = _Live(config)
            self._queue.append(job_id)
            self._cond.notify_all()
            self._dispatch()
        log.info("job %s (%s) accepted", job_id, config.name)
        return self.get(job_id), True

    def get(self, job_id: str) -> JobRecord:
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def list(self, state: str | None = None) -> list[JobRecord]:
        """Every job (newest first), optionally of one state."""
        jobs, token = self.list_page(state, MAX_PAGE_SIZE)
        while token:
            page, token = self.list_page(state, MAX_PAGE_SIZE, token)
            jobs += page
        return jobs

    def list_page(self, state: str | None, page_size: int = 0, page_token: str = "") -> tuple[list[JobRecord], str]:
        """One page of jobs, newest first, and the token of the next page ("" on the last one)."""
        if state is not None and state not in STATES:
            raise ValueError(f"state: expected one of {', '.join(STATES)}, got {state!r}")
        if page_size < 0:
            raise ValueError(f"page_size: must be >= 0, got {page_size}")
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        jobs, cursor = self.store.list_jobs(state, size, _decode_token(page_token) if page_token else None)
        return jobs, ("" if cursor is None else _encode_token(cursor))

    def scale_engines(self, rollouts: list[str]) -> list[str]:
        """The engines jobs may use from now on (static lists only: EnginesDiscovered otherwise);
        running jobs take the change at their next step boundary (`RLLoop.admit_engines`)."""
        scale = getattr(self._make_fleet, "scale_engines", None)
        if scale is None:
            raise EnginesDiscovered("this coordinator discovers its rollout engines (Kubernetes): scale the rollout "
                                    "StatefulSet (kubectl scale) instead")
        return scale(rollouts)

    def cancel(self, job_id: str, *, strict: bool = False) -> JobRecord:
        """Cancel a pending job now, a running one at its next step; `strict` refuses finished jobs."""
        with self._cond:
            job = self.get(job_id)
            if job.state in (SUCCEEDED, FAILED):
                if strict:
                    raise JobFinished(f"job {job_id} already {job.state}; only pending or running jobs can be cancelled")
                return job
            if job.state == CANCELLED:
                return job
            live = self._live.get(job_id)
            if live is not None:
                live.cancel.set()
            if job_id in self._queue:
                self._queue.remove(job_id)
                record = self._finish(job_id, CANCELLED, "cancelled before it started")
                self._live.pop(job_id, None)  # it never gets a thread that would drop it
                return record or self.get(job_id)
            if not job.cancel_requested:
                job = self._append(job_id, "log", job.step, {"message": "cancel requested; the job stops at its next step"},
                                   {"cancel_requested": True}) or job
        log.info("job %s: cancel requested", job_id)
        return job

    def wait_events(self, job_id: str, after_seq: int, timeout_s: float, limit: int = 500) -> tuple[list[Event], bool]:
        """Stored events after `after_seq` (waiting up to timeout_s for one), and whether the log is complete.

        `True` means the job has ended and every event was already delivered.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:  # appends hold it too, so the state and the log are read as one snapshot
            while True:
                job = self.get(job_id)
                events = self.store.events(job_id, after_seq, limit)
                if events:
                    return events, False
                if job.state in TERMINAL:
                    return [], True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return [], False
                self._cond.wait(remaining)

    def watch(self, job_id: str, after_seq: int = 0, stop: threading.Event | None = None,
              follow: bool = True) -> Iterator[Event]:
        """Events after `after_seq`, then (with follow) live ones until the job ends or `stop` is set."""
        seq = after_seq
        while True:
            events, done = self.wait_events(job_id, seq, 0.5 if follow else 0.0)
            yield from events
            if events:
                seq = events[-1].seq
            if done or (not events and (not follow or (stop is not None and stop.is_set()))):
                return

    def reward_plot(self, job_id: str) -> bytes:
        """The reward-curve PNG drawn from the stored step metrics and eval results."""
        job = self.get(job_id)
        with tempfile.TemporaryDirectory(prefix="rlfleet-plot-") as tmp:
            writer = MetricsWriter(tmp)
            for m in self.store.step_metrics(job_id):
                writer.write_step(m.step, m.metrics, time=m.time)
            for e in self.store.eval_results(job_id):
                writer.write_eval(e.step, {"dataset": e.dataset, **e.metrics}, time=e.time)
            return plot_rewards(tmp, title=f"{job.name} ({job.id}): reward").read_bytes()

    def close(self, reason: str = SHUTDOWN_REASON) -> None:
        """Stop accepting work; queued jobs stay pending; running ones are told to stop, and stay
        `running` to resume at the next start when they have a checkpoint, else are marked failed."""
        with self._cond:
            self._closed = True
            for job_id in list(self._running):
                live = self._live[job_id]
                live.cancel.set()
                if self.store.checkpoints(job_id):
                    live.done = True  # the loop's last events are dropped; the stored state stays running
                    log.warning("job %s: coordinator stopping; it resumes from its last checkpoint at the next start", job_id)
                    continue
                self._finish(job_id, FAILED, reason)
                log.warning("job %s: %s", job_id, reason)

    # ---- running ---------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Start queued jobs while there is room (call with the lock held)."""
        while self._queue and len(self._running) < self._max_running and not self._closed:
            job_id = self._queue.popleft()
            self._running.add(job_id)
            threading.Thread(target=self._run, args=(job_id,), name=f"job-{job_id}", daemon=True).start()

    def _run(self, job_id: str) -> None:
        live = self._live[job_id]
        try:
            with self._cond:
                if live.cancel.is_set():
                    self._finish(job_id, CANCELLED, "cancelled before it started")
                    return
                record = self._append(job_id, "state", 0, {}, {"state": RUNNING})
            if record is None:
                return
            self._execute(record, live)
        finally:
            with self._cond:
                self._running.discard(job_id)
                self._live.pop(job_id, None)
                self._dispatch()

    def _execute(self, record: JobRecord, live: _Live) -> None:
        output_dir = Path(record.output_dir)
        tracker: Tracker = NullTracker()
        summary: dict = {}
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            writer = MetricsWriter(output_dir)
            (output_dir / "job.yaml").write_text(record.config_yaml)
            resume = self._resume(record.id, writer, live.resume) if live.resume is not None else None
            fleet: Fleet | None = None
            for restarts in itertools.count():
                # TensorBoard and W&B, when the job asks for them (a tracker that cannot start fails the job now)
                tracker = build_tracker(live.config.tracking, output_dir, run_name=f"{record.name}-{record.id}",
                                        run_id=record.id, config=to_dict(live.config),
                                        resume_step=resume.step if resume is not None else None)
                if fleet is None:
                    fleet = self._make_fleet(live.config)
                try:
                    summary = self._run_loop(record.id, live, fleet, resume, writer, tracker)
                    break
                except Exception as e:
                    lost = lost_trainer(e, fleet.trainer_servers)
                    if lost is None:
                        raise
                    checkpoint = self._restart_point(record.id, lost, fleet, restarts)  # TrainerLost when none
                tracker.close()  # the steps after the checkpoint are logged again, by a tracker resumed there
                tracker = NullTracker()
                close_clients(fleet)
                fleet = wait_for_trainers(self._make_fleet, live.config, live.cancel, self._trainer_wait_s)
                resume = self._resume(record.id, writer, checkpoint)
            summary["output_dir"] = str(output_dir)
            summary["plot"] = str(plot_rewards(output_dir))
            (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            state, error = SUCCEEDED, ""
        except JobCancelled:
            state, error, summary = CANCELLED, "cancelled", {}
        except Exception as e:  # the job fails, the coordinator lives on
            log.error("job %s failed: %s\n%s", record.id, e, traceback.format_exc())
            state, error, summary = FAILED, f"{type(e).__name__}: {e}", {}
        finally:
            tracker.close(summary)
        with self._cond:
            stored = self._finish(record.id, state, error, summary)
        if stored is not None:  # None: close() already ended it
            log.info("job %s %s%s", record.id, state, f": {error}" if error else "")

    def _run_loop(self, job_id: str, live: _Live, fleet: Fleet, resume: Resume | None, writer: MetricsWriter,
                  tracker: Tracker) -> dict:
        """One RLLoop on `fleet` to its end; every event it emits is written, tracked and stored."""

        def emit(kind: str, step: int, data: dict) -> None:
            updates = None
            if kind == "step":
                writer.write_step(step, data)
                updates = {"step": step}
            elif kind == "eval":
                writer.write_eval(step, data)
            tracker.log(kind, step, data)  # never raises: a failing tracker is dropped
            with self._cond:
                self._append(job_id, kind, step, data, updates)

        loop = RLLoop(live.config, fleet, emit, live.cancel, resume=resume)
        try:
            return loop.run()
        finally:
            loop.close()

    def _resume(self, job_id: str, writer: MetricsWriter, checkpoint: Checkpoint) -> Resume:
        """Run on from `checkpoint`: the steps after it run again (their old lines and stored
        results go), and the evals before training are the stored ones."""
        writer.drop_after(checkpoint.step)
        with self._cond:
            self.store.drop_after(job_id, checkpoint.step)
        before = {e.dataset: e.score for e in self.store.eval_results(job_id) if e.step == 0}
        at = [m.metrics for m in self.store.step_metrics(job_id) if m.step == checkpoint.step]
        dealt, drawn = (at[-1].get("batches_dealt"), at[-1].get("seeds_drawn")) if at else (None, None)
        return Resume(step=checkpoint.step, path=checkpoint.path, evals_before=before,
                      batches_dealt=None if dealt is None or drawn is None else int(dealt),
                      seeds_drawn=None if dealt is None or drawn is None else int(drawn))

    def _restart_point(self, job_id: str, lost: PeerError, fleet: Fleet, restarts: int) -> Checkpoint:
        """The checkpoint a job that lost a trainer restarts from, announced in its log; TrainerLost
        saying why when it cannot restart (no checkpoint, or no restart left)."""
        who = ", ".join(gone(fleet.trainer_servers)) or lost.peer  # a rank's error can name a live peer
        after = self.get(job_id).step
        what = f"trainer {who} lost after step {after} ({lost})"
        checkpoints = self.store.checkpoints(job_id)
        if self._trainer_restarts == 0:
            raise TrainerLost(f"{what}; trainer restarts are off (--trainer-restarts 0)") from lost
        if not checkpoints:
            raise TrainerLost(f"{what} and the job has no checkpoint to resume from; set checkpoint.every") from lost
        if restarts >= self._trainer_restarts:
            raise TrainerLost(f"{what}, and the job already restarted {restarts} times "
                              f"(--trainer-restarts {self._trainer_restarts})") from lost
        checkpoint = checkpoints[-1]
        message = (f"{what}; the job resumes from its checkpoint of step {checkpoint.step} once every trainer answers "
                   f"(restart {restarts + 1} of {self._trainer_restarts})")
        with self._cond:
            self._append(job_id, "log", checkpoint.step, {"message": message}, {"step": checkpoint.step})
        log.warning("job %s: %s", job_id, message)
        return checkpoint

    def _finish(self, job_id: str, state: str, error: str, summary: dict | None = None) -> JobRecord | None:
        """Store a terminal state (with the lock held); None when the job had already ended here."""
        live = self._live.get(job_id)
        if live is not None and live.done:
            return None
        updates = {"state": state, "error": error, "cancel_requested": False}
        if summary:
            updates["summary"] = summary
        record = self._append(job_id, "state", self.get(job_id).step, {"error": error} if error else {}, updates)
        if live is not None:
            live.done = True
        return record

    def _append(self, job_id: str, kind: str, step: int, data: dict, updates: dict | None = None) -> JobRecord | None:
        """Persist one event (with the lock held); None when the job already ended here."""
        live = self._live.get(job_id)
        if live is not None and live.done:
            return None  # e.g. a loop still running after close() marked its job failed
        job, _ = self.store.append_event(job_id, kind, time.time(), step, data, updates)
        self._cond.notify_all()
        return job

    # ---- restart ---------------------------------------------------------------------------------
    def _recover(self) -> None:
        """Apply the restart policy to jobs a previous coordinator left unfinished."""
        with self._cond:
            for job in self.store.unfinished_jobs():
                checkpoints = self.store.checkpoints(job.id) if job.state == RUNNING else []
                if job.state == RUNNING and not checkpoints:
                    self._finish(job.id, FAILED, RESTART_REASON)
                    log.warning("job %s (%s): %s", job.id, job.name, RESTART_REASON)
                    continue
                try:
                    config = parse_job(job.config_yaml, job.base_dir)
                except ConfigError as e:
                    self._finish(job.id, FAILED, f"coordinator restarted and the job's config no longer loads: {e}")
                    continue
                resume = checkpoints[-1] if checkpoints else None
                self._live[job.id] = _Live(config, resume=resume)
                self._queue.append(job.id)
                if resume is not None:
                    message = f"coordinator restarted; the job resumes from its checkpoint of step {resume.step}"
                    self._append(job.id, "log", resume.step, {"message": message}, {"state": PENDING})
                else:
                    message = "coordinator restarted; the job is still queued"
                    self._append(job.id, "log", 0, {"message": message})
                log.info("job %s (%s): %s", job.id, job.name, message)
            self._dispatch()

    def _same_request(self, existing: JobRecord, request_hash: str) -> JobRecord:
        if existing.request_hash != request_hash:
            raise RequestConflict(
                f"request_id: {existing.request_id!r} was already used for job {existing.id} with a different "
                "config_yaml or base_dir; use a new request_id for a new job"
            )
        return existing


def _check_text(**fields) -> None:
    """Text the store keeps must be valid Unicode (JSON or YAML escapes can smuggle in lone surrogates)."""
    for name, value in fields.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{name}: contains text that is not valid Unicode (a lone surrogate)") from None


def _encode_token(cursor: int) -> str:
    return base64.urlsafe_b64encode(f"v1:{cursor}".encode()).decode().rstrip("=")


def _decode_token(token: str) -> int:
    try:
        text = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        version, _, cursor = text.partition(":")
        if version != "v1":
            raise ValueError(version)
        return int(cursor)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise ValueError(f"page_token: not a token this coordinator issued: {token[:40]!r}") from None
