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


@contextlib.contextmanager
def channel(address: str):
    ch = rpc.open_channel(address)
    try:
        yield ch
    finally:
        ch.close()
