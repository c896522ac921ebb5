"""One coordinator process: job store, JobManager, gRPC server and (optionally) the REST server.

`build_coordinator` wires them together for `rlfleet serve coordinator`; the object it returns
stops them in the right order: health goes NOT_SERVING, running jobs are marked failed (so
watchers see the end instead of hanging), REST and gRPC drain, and the store is closed last.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from services import rpc
from services.coordinator.jobs import JobManager
from services.coordinator.server import build_server
from services.coordinator.store import JobStore, open_store
from services.tls import TlsConfig

log = rpc.get_logger("coordinator")
DEFAULT_DB = "./rlfleet-jobs.db"


@dataclass
class CoordinatorService:
    manager: JobManager
    store: JobStore
    grpc: rpc.Server
    rest: object | None  # rest.RestServer; imported lazily, FastAPI is only needed with --http-port

    @property
    def port(self) -> int:
        return self.grpc.port

    @property
    def http_port(self) -> int | None:
        return self.rest.port if self.rest is not None else None

    def set_serving(self, serving: bool) -> None:
        self.grpc.set_serving(serving)

    def stop(self, grace_s: float = 5.0) -> None:
        self.grpc.set_serving(False)
        self.manager.close()
        if self.rest is not None:
            self.rest.stop(grace_s)
        self.grpc.stop(grace_s)
        self.store.close()

    def wait_for_termination_or_signal(self, grace_s: float = 5.0) -> None:
        rpc.wait_for_signal()
        self.stop(grace_s)


def freeze_heap() -> None:
    """Take what the process has loaded so far out of the garbage collector's work (gc.freeze),
    after importing what a job's steps use (torch, through the advantages). Call it once, from
    the process's entry, when startup is done.

    A step keeps thousands of samples alive for seconds, so they reach the oldest generation and
    a full collection runs every few steps; each walked the ~180k objects of the loaded modules
    (0.17-0.23 s a collection with torch loaded) and found nothing to free, since a step's objects
    are acyclic and go by reference counting. Frozen objects are never walked again; they were
    never going to be garbage."""
    import gc

    import services.coordinator.advantages  # noqa: F401  (torch: the first step would import it)

    gc.freeze()


def build_coordinator(
    make_fleet: Callable,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    db: str | None = DEFAULT_DB,
    runs_dir: Path = Path("runs"),
    http_port: int | None = None,
    max_running: int = 1,
    allowed_reward_modules: tuple[str, ...] = (),
    trainer_restarts: int = 3,
    trainer_wait_s: float = 600.0,
) -> CoordinatorService:
    """Open the store (a restart applies the restart policy to unfinished jobs) and start serving."""
    store = open_store(db)
    manager = JobManager(make_fleet, runs_dir=runs_dir, store=store, max_running=max_running,
                         allowed_reward_modules=allowed_reward_modules, trainer_restarts=trainer_restarts,
                         trainer_wait_s=trainer_wait_s)
    server = build_server(manager, f"{host}:{port}", token)
    rest = None
    if http_port is not None:
        from services.coordinator.rest import RestServer, create_app

        tls = TlsConfig.from_env()  # the process's, as its gRPC server's (see services.tls)
        rest = RestServer(create_app(manager, token), host, http_port, tls=tls)
        log.info("REST on %s://%s:%d (OpenAPI at /openapi.json)", "https" if tls and tls.serves else "http", host,
                 rest.port)
    log.info("job store: %s", "memory" if db in (None, "memory") else Path(db).absolute())
    return CoordinatorService(manager, store, server, rest)
