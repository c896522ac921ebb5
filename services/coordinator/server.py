"""gRPC servicer of `rlfleet.v1.Coordinator`: jobs as resources over the JobManager."""

from __future__ import annotations

import json
import threading

import grpc

from services import rpc
from services.api import coordinator_pb2, coordinator_pb2_grpc
from services.coordinator.config import ConfigError
from services.coordinator.jobs import JobManager, JobNotFound, JobRecord

SERVICE_NAME = "rlfleet.v1.Coordinator"
_ERRORS = {ConfigError: grpc.StatusCode.INVALID_ARGUMENT, ValueError: grpc.StatusCode.INVALID_ARGUMENT,
           JobNotFound: grpc.StatusCode.NOT_FOUND}
_STATES = {
    "pending": coordinator_pb2.JOB_STATE_PENDING,
    "running": coordinator_pb2.JOB_STATE_RUNNING,
    "succeeded": coordinator_pb2.JOB_STATE_SUCCEEDED,
    "failed": coordinator_pb2.JOB_STATE_FAILED,
    "cancelled": coordinator_pb2.JOB_STATE_CANCELLED,
}
_STATE_NAMES = {v: k for k, v in _STATES.items()}


def job_to_proto(job: JobRecord) -> coordinator_pb2.Job:
    return coordinator_pb2.Job(
        id=job.id,
        name=job.name,
        state=_STATES[job.state],
        config_yaml=job.config_yaml,
        step=job.step,
        num_steps=job.num_steps,
        error=job.error,
        created_at=job.created_at,
        updated_at=job.updated_at,
        summary_json=json.dumps(job.summary) if job.summary else "",
        output_dir=str(job.output_dir),
    )


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, manager: JobManager):
        self.manager = manager

    def CreateJob(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            if not request.config_yaml.strip():
                raise ValueError("config_yaml: empty job config")
            return job_to_proto(self.manager.create(request.config_yaml, request.base_dir, request.request_id))

    def GetJob(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            return job_to_proto(self.manager.get(request.job_id))

    def ListJobs(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            if request.page_size < 0:
                raise ValueError("page_size: must be >= 0")
            size = request.page_size or 50
            try:
                start = int(request.page_token or 0)
            except ValueError:
                raise ValueError(f"page_token: invalid token {request.page_token!r}") from None
            state = _STATE_NAMES.get(request.state) if request.state else None
            jobs = self.manager.list(state)
            page = jobs[start : start + size]
            token = str(start + size) if start + size < len(jobs) else ""
            return coordinator_pb2.ListJobsResponse(jobs=[job_to_proto(j) for j in page], next_page_token=token)

    def CancelJob(self, request, context):
        with rpc.abort_on(context, _ERRORS):
            return job_to_proto(self.manager.cancel(request.job_id))

    def WatchJob(self, request, context):
        stop = threading.Event()
        context.add_callback(stop.set)
        with rpc.abort_on(context, _ERRORS):
            events = self.manager.watch(request.job_id, request.after_seq, stop)
            for e in events:
                yield coordinator_pb2.JobEvent(
                    seq=e.seq, job_id=e.job_id, kind=e.kind, time=e.time, state=_STATES[e.state],
                    step=e.step, data_json=json.dumps(e.data),
                )


def build_server(manager: JobManager, address: str = "127.0.0.1:0", token: str | None = None) -> rpc.Server:
    servicer = CoordinatorServicer(manager)
    server = rpc.create_server(
        lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s),
        (SERVICE_NAME,),
        address=address,
        token=token,
    )
    server.set_serving(True)
    return server
