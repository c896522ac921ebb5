"""gRPC servicer of `rlfleet.v1.Coordinator`: jobs as resources over the JobManager.

The servicer only translates protobuf to JobManager calls and typed errors to status codes:
ConfigError / ValueError -> INVALID_ARGUMENT (the message names the field), JobNotFound ->
NOT_FOUND, a reused request_id -> ALREADY_EXISTS, cancelling a finished job -> FAILED_PRECONDITION.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading

import grpc

from services import rpc
from services.api import coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.config import ConfigError
from services.coordinator.fleet import EnginesDiscovered
from services.coordinator.jobs import JobFinished, JobManager, JobNotFound, RequestConflict
from services.coordinator.store import Event, JobRecord

SERVICE_NAME = "rlfleet.v1.Coordinator"
_ERRORS = {
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    JobNotFound: grpc.StatusCode.NOT_FOUND,
    RequestConflict: grpc.StatusCode.ALREADY_EXISTS,
    JobFinished: grpc.StatusCode.FAILED_PRECONDITION,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    sqlite3.DatabaseError: grpc.StatusCode.UNAVAILABLE,  # a damaged job store page: say so, keep serving
}
STATES = {
    "pending": coordinator_pb2.JOB_STATE_PENDING,
    "running": coordinator_pb2.JOB_STATE_RUNNING,
    "succeeded": coordinator_pb2.JOB_STATE_SUCCEEDED,
    "failed": coordinator_pb2.JOB_STATE_FAILED,
    "cancelled": coordinator_pb2.JOB_STATE_CANCELLED,
}
STATE_NAMES = {v: k for k, v in STATES.items()}


def job_to_proto(job: JobRecord) -> coordinator_pb2.Job:
    return coordinator_pb2.Job(
        id=job.id,
        name=job.name,
        state=STATES[job.state],
        config_yaml=job.config_yaml,
        step=job.step,
        num_steps=job.num_steps,
        error=job.error,
        created_at=job.created_at,
        updated_at=job.updated_at,
        summary_json=json.dumps(job.summary) if job.summary else "",
        output_dir=job.output_dir,
        request_id=job.request_id,
        base_dir=job.base_dir,
        cancel_requested=job.cancel_requested,
    )


def event_to_proto(e: Event) -> coordinator_pb2.JobEvent:
    return coordinator_pb2.JobEvent(
        seq=e.seq, job_id=e.job_id, kind=e.kind, time=e.time, state=STATES[e.state], step=e.step,
        data_json=json.dumps(e.data),
    )


def _numbers(values: dict) -> dict[str, float]:
    """The finite numeric entries of a metrics dict (proto doubles; strings and nulls are left out)."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, manager: JobManager):
        self.manager = manager

    def CreateJob(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            return job_to_proto(self.manager.create(request.config_yaml, request.base_dir, request.request_id))

    def GetJob(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            return job_to_proto(self.manager.get(request.job_id))

    def ListJobs(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            if request.state and request.state not in STATE_NAMES:
                raise ValueError(f"state: unknown job state {request.state}")
            jobs, token = self.manager.list_page(STATE_NAMES.get(request.state), request.page_size, request.page_token)
            return coordinator_pb2.ListJobsResponse(jobs=[job_to_proto(j) for j in jobs], next_page_token=token)

    def CancelJob(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            return job_to_proto(self.manager.cancel(request.job_id, strict=True))

    def WatchJob(self, request, context):
        stop = threading.Event()
        context.add_callback(stop.set)
        with rpc.abort_on(context, _ERRORS):
            self.manager.get(request.job_id)  # NOT_FOUND before the stream starts
            for event in self.manager.watch(request.job_id, request.after_seq, stop, follow=not request.replay_only):
                yield event_to_proto(event)

    def ScaleEngines(self, request, context):
        with rpc.abort_on(context, {**_ERRORS, EnginesDiscovered: grpc.StatusCode.FAILED_PRECONDITION}):
            return coordinator_pb2.ScaleEnginesResponse(rollouts=self.manager.scale_engines(list(request.rollouts)))

    def GetJobMetrics(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            job = self.manager.get(request.job_id)
            store = self.manager.store
            return coordinator_pb2.JobMetrics(
                job_id=job.id,
                steps=[coordinator_pb2.StepMetrics(step=m.step, time=m.time, metrics=_numbers(m.metrics))
                       for m in store.step_metrics(job.id)],
                evals=[coordinator_pb2.EvalResult(step=e.step, time=e.time, dataset=e.dataset,
                                                  score=e.score if e.score is not None else math.nan,
                                                  metrics=_numbers(e.metrics))
                       for e in store.eval_results(job.id)],
                checkpoints=[coordinator_pb2.Checkpoint(step=c.step, time=c.time, path=c.path)
                             for c in store.checkpoints(job.id)],
            )


def build_server(manager: JobManager, address: str = "127.0.0.1:0", token: str | None = None) -> rpc.Server:
    servicer = CoordinatorServicer(manager)
    server = rpc.create_server(
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        (SERVICE_NAME,),
        address=address,
        token=token,
        max_workers=64,  # each WatchJob stream holds a worker thread for as long as the job runs
    )
    server.set_serving(True)
    return server
