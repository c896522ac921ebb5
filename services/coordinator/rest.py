"""REST front of the coordinator (FastAPI), the same JobManager the gRPC servicer serves.

  POST /v1/jobs                         create: {"config_yaml": str} or {"config": {...}}, with optional
                                        "base_dir" and "request_id"; 201 new job, 200 a known request_id
  GET  /v1/jobs                         list, newest first: page_size, page_token, state
  GET  /v1/jobs/{id}                    one job
  POST /v1/jobs/{id}:cancel             cancel (409 when it already succeeded or failed)
  GET  /v1/jobs/{id}/events             server-sent events: replay after after_seq (or Last-Event-ID), follow
  GET  /v1/jobs/{id}/metrics            step metrics, eval results and checkpoints as JSON
  GET  /v1/jobs/{id}/plots/reward.png   the reward curve drawn from the stored metrics
  GET  /v1/schema/job                   JSON Schema of job configs
  GET  /healthz, /metrics               liveness and Prometheus metrics (never need the token)
  GET  /openapi.json, /docs             this API

Errors are `{"detail": message}`: 400 a malformed request or invalid job config (the message names
the field), 401 a missing or wrong bearer token, 404 an unknown job, 409 a reused request_id or a
cancel of a finished job. Handlers only translate HTTP to JobManager calls. `RestServer` runs
uvicorn in a thread beside the gRPC server, on a socket bound up front so port 0 works.
"""

from __future__ import annotations

import hmac
import socket
import sqlite3
import threading
import time
from enum import Enum
from typing import Any

import anyio
import uvicorn
import yaml
from fastapi import Depends, FastAPI, Header, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.routing import Match

from services import rpc
from services.coordinator.config import ConfigError, job_json_schema
from services.coordinator.jobs import JobFinished, JobManager, JobNotFound, RequestConflict
from services.coordinator.store import STATES, Event, JobRecord
from services.tls import TlsConfig

log = rpc.get_logger("coordinator.rest")
MAX_SEQ = 2**63 - 1
HEARTBEAT_S = 15.0


# ---- wire models ----------------------------------------------------------------------------------
class JobState(str, Enum):
    pending = "pending"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


assert tuple(s.value for s in JobState) == STATES


class Job(BaseModel):
    id: str
    name: str
    state: JobState
    step: int = Field(description="last RL step reported")
    num_steps: int = Field(description="num_rollout of the config; 0 for an eval-only job")
    error: str = Field(description="why the job failed or was cancelled; empty otherwise")
    cancel_requested: bool = Field(description="a cancel waits for the running job's next step boundary")
    created_at: float = Field(description="unix seconds")
    updated_at: float
    request_id: str
    base_dir: str
    output_dir: str
    summary: dict[str, Any] = Field(description="set when the job succeeded: eval_before, eval_after, steps, wall_s, ...")
    config_yaml: str = Field(description="the resolved config the job runs (absolute paths)")


class JobList(BaseModel):
    jobs: list[Job]
    next_page_token: str = Field(description="pass as page_token for the next page; empty on the last page")


class CreateJob(BaseModel):
    """A job config as YAML text (`config_yaml`) or as a JSON object (`config`, see /v1/schema/job)."""

    model_config = ConfigDict(extra="forbid")
    config_yaml: str | None = Field(None, description="the job config as YAML (exactly one of config_yaml, config)")
    config: dict[str, Any] | None = Field(None, description="the job config as a JSON object, as /v1/schema/job describes")
    base_dir: str = Field("", description="directory relative paths in the config are resolved against "
                          "(on the coordinator); empty = the coordinator's working directory")
    request_id: str = Field("", max_length=128, description="a retried create with the same request_id returns "
                            "the same job (also after a coordinator restart)")

    @model_validator(mode="after")
    def _exactly_one_config(self) -> "CreateJob":
        if (self.config_yaml is None) == (self.config is None):
            raise ValueError("give exactly one of config_yaml (YAML text) and config (a JSON object)")
        return self


class StepMetrics(BaseModel):
    step: int
    time: float
    metrics: dict[str, float | None]


class EvalResult(BaseModel):
    step: int
    time: float
    dataset: str
    score: float | None
    metrics: dict[str, float | None]


class Checkpoint(BaseModel):
    step: int
    time: float
    path: str


class JobMetrics(BaseModel):
    job_id: str
    steps: list[StepMetrics]
    evals: list[EvalResult]
    checkpoints: list[Checkpoint]


class JobEvent(BaseModel):
    """One event of a job, the `data` of a server-sent event."""

    seq: int
    job_id: str
    kind: str = Field(description="state | step | eval | weight_sync | log | sft | checkpoint")
    time: float
    state: JobState = Field(description="the job's state once this event happened")
    step: int
    data: dict[str, Any] = Field(description="the payload: step metrics, eval scores, sync stats, a message, ...")


# Each server-sent event, as OpenAPI (3.1 without itemSchema) and schemathesis read `schema` of a stream.
_SSE_EVENT_SCHEMA = {
    "type": "object",
    "required": ["id", "event", "data"],
    "properties": {
        "id": {"type": "string", "description": "the event's seq (send it back as Last-Event-ID)"},
        "event": {"type": "string", "description": "the event's kind"},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"$ref": "#/components/schemas/JobEvent"}},
    },
}


class Health(BaseModel):
    status: str


class Error(BaseModel):
    detail: str


def _job(job: JobRecord) -> Job:
    return Job(
        id=job.id, name=job.name, state=JobState(job.state), step=job.step, num_steps=job.num_steps,
        error=job.error, cancel_requested=job.cancel_requested, created_at=job.created_at,
        updated_at=job.updated_at, request_id=job.request_id, base_dir=job.base_dir, output_dir=job.output_dir,
        summary=job.summary, config_yaml=job.config_yaml,
    )


def _numbers(values: dict) -> dict[str, float | None]:
    return {k: (None if v is None else float(v)) for k, v in values.items()
            if v is None or (isinstance(v, int | float) and not isinstance(v, bool))}


def _sse(event: Event) -> str:
    payload = JobEvent(seq=event.seq, job_id=event.job_id, kind=event.kind, time=event.time,
                       state=JobState(event.state), step=event.step, data=event.data)
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {payload.model_dump_json()}\n\n"


class _EventStream(StreamingResponse):
    media_type = "text/event-stream"


class _Png(Response):
    media_type = "image/png"


class _JobIdConvertor(Convertor[str]):
    """A job id never holds ':' or '/', so GET /v1/jobs/{id} does not also match POST /v1/jobs/{id}:cancel."""

    regex = "[^/:]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


JobId = Path(pattern="^[^/:]+$", description="a job's id")


# ---- the app ----------------------------------------------------------------------------------------
_JOB_ERRORS = {404: {"model": Error, "description": "no job with this id"}}
_BAD_REQUEST = {400: {"model": Error, "description": "malformed request; the message names the field"}}


def _known_query_only(request: Request) -> None:
    """A query parameter the route does not take is a mistake (a misspelt `page_size` would
    otherwise be ignored silently): 400 naming it."""
    route = request.scope.get("route")
    allowed, todo = set(), [route.dependant] if route is not None else []
    while todo:  # the route's own parameters and its dependencies'
        dependant = todo.pop()
        allowed |= {p.alias for p in dependant.query_params}
        todo += dependant.dependencies
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise HTTPException(400, f"query: unknown parameter {unknown[0]!r}"
                                 + (f" (this route takes {', '.join(sorted(allowed))})" if allowed else ""))


def create_app(manager: JobManager, token: str | None = None) -> FastAPI:
    """The REST API over `manager`; with `token`, every /v1 route needs `Authorization: Bearer <token>`."""
    app = FastAPI(
        title="rlfleet coordinator",
        version="1",
        description="RL post-training jobs as resources. The same API is served over gRPC as rlfleet.v1.Coordinator.",
    )
    bearer = HTTPBearer(auto_error=False, description="the coordinator's token (--token-file / RLFLEET_TOKEN)")

    def authenticate(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = credentials.credentials.encode() if credentials is not None else b""
        if not hmac.compare_digest(given, token.encode()):
            raise HTTPException(401, "missing or invalid bearer token", headers={"WWW-Authenticate": "Bearer"})

    register_url_convertor("job_id", _JobIdConvertor())  # idempotent; Starlette keeps convertors in a table
    guarded = ([Depends(authenticate)] if token else []) + [Depends(_known_query_only)]
    auth_errors = {401: {"model": Error, "description": "missing or invalid bearer token"}} if token else {}

    def v1(method: str, path: str, responses: dict | None = None, **kwargs):
        """A /v1 route: token-guarded, 400 and 401 documented. Routes stay flat on the app (see http_error)."""
        return app.api_route(f"/v1{path}", methods=[method], dependencies=guarded,
                             responses={**auth_errors, **_BAD_REQUEST, **(responses or {})}, **kwargs)

    @v1("POST", "/jobs", status_code=201, response_model=Job,
        responses={200: {"model": Job, "description": "a job with this request_id exists: that job"},
                   201: {"description": "the job was created and queued"},
                   409: {"model": Error, "description": "request_id was used for a different config"}})
    def create_job(body: CreateJob, response: Response) -> Job:
        text = body.config_yaml
        if body.config is not None:
            try:
                text = yaml.safe_dump(body.config, sort_keys=False)
            except RecursionError as e:
                raise ConfigError("config: nested too deeply") from e
        job, created = manager.submit(text, body.base_dir, body.request_id)
        response.status_code = 201 if created else 200
        response.headers["Location"] = f"/v1/jobs/{job.id}"
        return _job(job)

    @v1("GET", "/jobs", response_model=JobList)
    def list_jobs(
        page_size: int = Query(0, ge=0, le=MAX_SEQ, description="0 = 50; larger than 1000 is read as 1000"),
        page_token: str = Query("", description="next_page_token of the previous page"),
        state: JobState | None = Query(None, description="only jobs in this state"),
    ) -> JobList:
        jobs, token_ = manager.list_page(state.value if state else None, page_size, page_token)
        return JobList(jobs=[_job(j) for j in jobs], next_page_token=token_)

    @v1("GET", "/jobs/{job_id:job_id}", response_model=Job, responses=_JOB_ERRORS)
    def get_job(job_id: str = JobId) -> Job:
        return _job(manager.get(job_id))

    @v1("POST", "/jobs/{job_id:job_id}:cancel", response_model=Job,
        responses={**_JOB_ERRORS, 409: {"model": Error, "description": "the job already succeeded or failed"}})
    def cancel_job(job_id: str = JobId) -> Job:
        return _job(manager.cancel(job_id, strict=True))

    @v1(
        "GET", "/jobs/{job_id:job_id}/events", response_class=_EventStream,
        responses={**_JOB_ERRORS, 200: {"description": "server-sent events: `id` is the event's seq, `event` its "
               "kind, `data` a JSON object {seq, job_id, kind, time, state, step, data}",
               "content": {"text/event-stream": {"schema": _SSE_EVENT_SCHEMA}}}},
    )
    async def job_events(
        request: Request,
        job_id: str = JobId,
        after_seq: int = Query(0, ge=0, le=MAX_SEQ, description="replay events with a larger seq"),
        follow: bool = Query(True, description="after the replay, stream new events until the job ends"),
        last_event_id: str | None = Header(None, description="a reconnecting EventSource's last seq; "
                                           "overrides after_seq"),
    ):
        manager.get(job_id)  # 404 before the stream starts
        start = after_seq
        if last_event_id is not None:
            try:
                start = max(0, min(int(last_event_id), MAX_SEQ))
            except ValueError:
                raise ValueError(f"Last-Event-ID: expected an event seq, got {last_event_id[:40]!r}") from None

        async def stream():
            seq, quiet_since = start, time.monotonic()
            while True:
                events, done = await anyio.to_thread.run_sync(manager.wait_events, job_id, seq, 1.0 if follow else 0.0)
                for event in events:
                    yield _sse(event)
                    seq = event.seq
                if done or (not follow and not events):
                    return
                if events:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > HEARTBEAT_S:  # keeps proxies from closing an idle stream
                    quiet_since = time.monotonic()
                    yield ": keep-alive\n\n"
                if await request.is_disconnected():
                    return

        return _EventStream(stream(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @v1("GET", "/jobs/{job_id:job_id}/metrics", response_model=JobMetrics, responses=_JOB_ERRORS)
    def job_metrics(job_id: str = JobId) -> JobMetrics:
        job = manager.get(job_id)
        store = manager.store
        return JobMetrics(
            job_id=job.id,
            steps=[StepMetrics(step=m.step, time=m.time, metrics=_numbers(m.metrics)) for m in store.step_metrics(job.id)],
            evals=[EvalResult(step=e.step, time=e.time, dataset=e.dataset, score=e.score, metrics=_numbers(e.metrics))
                   for e in store.eval_results(job.id)],
            checkpoints=[Checkpoint(step=c.step, time=c.time, path=c.path) for c in store.checkpoints(job.id)],
        )

    @v1("GET", "/jobs/{job_id:job_id}/plots/reward.png", response_class=_Png,
        responses={**_JOB_ERRORS, 200: {"description": "the reward curve (train reward per step, eval scores)",
                                        "content": {"image/png": {"schema": {"type": "string", "format": "binary"}}}}})
    def reward_plot(job_id: str = JobId) -> _Png:
        return _Png(manager.reward_plot(job_id), headers={"Cache-Control": "no-cache"})

    schema = job_json_schema()

    @v1("GET", "/schema/job", response_model=dict[str, Any],
        description="JSON Schema (draft 2020-12) of a job config, as POST /v1/jobs takes it in `config`")
    def job_schema() -> dict[str, Any]:
        return schema

    _add_open_routes(app, manager)
    _add_error_handlers(app)
    _document_400_not_422(app)
    return app


def _add_open_routes(app: FastAPI, manager: JobManager) -> None:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StoreCollector(manager))

    @app.get("/healthz", response_model=Health, tags=["ops"])
    def healthz() -> Health:
        return Health(status="ok")

    @app.get("/metrics", tags=["ops"], response_class=Response,
             responses={200: {"description": "Prometheus text format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class _StoreCollector:
    """Prometheus metrics read from the job store at scrape time (nothing to keep in sync)."""

    def __init__(self, manager: JobManager):
        self.manager = manager

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.manager.store.stats()
        jobs = GaugeMetricFamily("rlfleet_jobs", "Jobs in the job store, by state", labels=["state"])
        for state, count in sorted(stats["jobs"].items()):
            jobs.add_metric([state], count)
        yield jobs
        yield CounterMetricFamily("rlfleet_steps", "RL steps recorded over all jobs", value=stats["steps"])
        events = CounterMetricFamily("rlfleet_events", "Job events recorded, by kind", labels=["kind"])
        for kind, count in sorted(stats["events"].items()):
            events.add_metric([kind], count)
        yield events
        running, _ = self.manager.list_page("running", 1000)
        step = GaugeMetricFamily("rlfleet_job_step", "Current RL step of each running job", labels=["job_id", "name"])
        total = GaugeMetricFamily("rlfleet_job_num_steps", "RL steps of each running job", labels=["job_id", "name"])
        for job in running:
            step.add_metric([job.id, job.name], job.step)
            total.add_metric([job.id, job.name], job.num_steps)
        yield step
        yield total


def _add_error_handlers(app: FastAPI) -> None:
    def error(status: int):
        async def handle(request: Request, exc: Exception) -> JSONResponse:
            return JSONResponse({"detail": str(exc)}, status_code=status)

        return handle

    # More specific first: ConfigError is a ValueError, and Starlette picks the first class in the MRO.
    app.add_exception_handler(JobNotFound, error(404))
    app.add_exception_handler(RequestConflict, error(409))
    app.add_exception_handler(JobFinished, error(409))
    app.add_exception_handler(ConfigError, error(400))
    app.add_exception_handler(ValueError, error(400))

    async def store_damaged(request: Request, exc: sqlite3.DatabaseError) -> JSONResponse:
        # A damaged page found at run time: say so (503), and keep serving what still reads.
        return JSONResponse({"detail": f"job store: {' '.join(str(exc).split())}"}, status_code=503)

    app.add_exception_handler(sqlite3.DatabaseError, store_damaged)

    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # "body.request_id: String should have at most 128 characters"; never echoes the input.
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            message = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            parts.append(f"{where}: {message}")
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, status_code=400)

    app.add_exception_handler(RequestValidationError, invalid_request)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette's Allow names only the first route that matched the path; a path served by
            # several routes (GET and POST /v1/jobs) must list them all.
            methods = set()
            for route in request.app.routes:
                match, _ = route.matches({**request.scope, "method": "GET"})
                if match != Match.NONE and getattr(route, "methods", None):
                    methods |= set(route.methods)
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)

    app.add_exception_handler(HTTPException, http_error)


def _document_400_not_422(app: FastAPI) -> None:
    """Validation errors are answered 400 {detail} (see above), so the schema says so instead of 422."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in spec.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None and "400" not in responses:
                        responses["400"] = {"description": "malformed request; the message names the field"}
                    for code, response in responses.items():
                        if int(code) >= 400:  # errors are JSON even where the success is a PNG or a stream
                            response["content"] = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
            schemas = spec.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for model in (Error, JobEvent):
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(model_schema.pop("$defs", {}))
                schemas.setdefault(model.__name__, model_schema)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi


# ---- serving beside gRPC ------------------------------------------------------------------------------
class RestServer:
    """uvicorn on its own thread and event loop; `port` is the bound port (port 0 picks one)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0,
                 tls: TlsConfig | None = None):
        """HTTPS with `tls` (a certificate to serve, and with client_auth a CA clients must chain to)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.port: int = sock.getsockname()[1]
        self.host = host
        https = tls.uvicorn_settings() if tls is not None and tls.serves else {}
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, server_header=False, **https)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="rest", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"REST server on {host}:{self.port} did not start")
            time.sleep(0.01)

    def stop(self, grace_s: float = 5.0) -> None:
        self._server.config.timeout_graceful_shutdown = max(1, int(grace_s))
        self._server.should_exit = True
        self._thread.join(grace_s + 2.0)
