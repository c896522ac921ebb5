"""A real fleet for integration tests: trainer, rollout engine and coordinator as processes on loopback."""

from __future__ import annotations

import contextlib

import pytest

from services import rpc
from services.launcher import LocalFleet


@pytest.fixture(scope="session")
def fleet(tmp_path_factory):
    """One trainer, one engine and a coordinator that knows them, each its own process."""
    logs = tmp_path_factory.mktemp("fleet-logs")
    local = LocalFleet(logs, env={"OMP_NUM_THREADS": "1"})
    try:
        # checkpoints of jobs writing under any test's tmp_path, and nowhere else
        trainer = local.start("trainer", "trainer-0", ["--checkpoint-root", str(tmp_path_factory.getbasetemp())])
        rollout = local.start("rollout", "rollout-0", [])
        local.wait_ready()
        local.start(
            "coordinator", "coordinator",
            ["--trainers", trainer.address, "--rollouts", rollout.address,
             "--runs-dir", str(tmp_path_factory.mktemp("runs")), "--db", "memory"],
        )
        local.wait_ready()
        yield local
    finally:
        local.stop()


def addresses(local: LocalFleet) -> dict[str, str]:
    return {child.role.split("-")[0]: child.address for child in local.children}


def run_job(address: str, config_yaml: str, *, token: str | None = None, tls=None, timeout_s: float = 180.0):
    """Submit a job to the coordinator at `address`, follow it to its end: (final Job, its events)."""
    from services.api import coordinator_pb2, coordinator_pb2_grpc

    with contextlib.closing(rpc.open_channel(address, token, tls=tls)) as ch:
        coordinator = coordinator_pb2_grpc.CoordinatorStub(ch)
        created = coordinator.CreateJob(coordinator_pb2.CreateJobRequest(config_yaml=config_yaml), timeout=30)
        events = list(coordinator.WatchJob(coordinator_pb2.WatchJobRequest(job_id=created.id), timeout=timeout_s))
        return coordinator.GetJob(coordinator_pb2.GetJobRequest(job_id=created.id), timeout=30), events


@contextlib.contextmanager
def channel(address: str):
    ch = rpc.open_channel(address)
    try:
        yield ch
    finally:
        ch.close()
