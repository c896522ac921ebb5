"""Doors a stranger could walk through: a server listening beyond loopback without a token, and a
trainer asked to write or read checkpoints outside its checkpoint root."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from services import rpc
from services.api import trainer_pb2, trainer_pb2_grpc
from services.trainer.server import build_server
from tests.integration.conftest import channel

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("role", ["trainer", "rollout", "coordinator"])
def test_serve_refuses_a_non_loopback_address_without_a_token(role, tmp_path):
    result = subprocess.run([sys.executable, "-m", "services.cli", "serve", role, "--host", "0.0.0.0", "--port", "0",
                             "--db", "memory"], capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": "."})
    assert result.returncode == 2
    assert "refusing to listen on 0.0.0.0 without authentication" in result.stderr


def test_create_server_binds_beyond_loopback_only_with_a_token():
    with pytest.raises(ValueError, match="refusing to serve 0.0.0.0:0 without a token"):
        build_server("0.0.0.0:0")
    assert rpc.is_loopback("127.0.0.1") and rpc.is_loopback("::1") and rpc.is_loopback("localhost")
    assert not rpc.is_loopback("0.0.0.0") and not rpc.is_loopback("10.0.0.7") and not rpc.is_loopback("example.org")
    server = build_server("0.0.0.0:0", token="s3cret")  # a token: any address
    server.stop(0)


@pytest.fixture
def trainer(tmp_path, tiny_model_dir):
    root = tmp_path / "root"
    root.mkdir()
    server = build_server("127.0.0.1:0", checkpoint_root=root)
    try:
        with channel(f"127.0.0.1:{server.port}") as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            stub.Configure(trainer_pb2.ConfigureTrainerRequest(config=trainer_pb2.TrainerConfig(
                model_path=str(tiny_model_dir), optimizer=trainer_pb2.OptimizerConfig(lr=1e-3))), timeout=60)
            yield stub, root
    finally:
        server.stop(0)


@pytest.mark.parametrize("path", ["../escape", "/tmp/rlfleet-elsewhere", "a/../../escape", "/dev/zero", "link/out"])
def test_checkpoints_outside_the_root_are_refused_by_name(trainer, tmp_path, path):
    stub, root = trainer
    (root / "link").symlink_to(tmp_path)  # a link inside the root pointing out of it
    for call in (lambda: stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path=path), timeout=30),
                 lambda: stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=path), timeout=30)):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "path:" in refused.value.details() and ("outside the checkpoint root" in refused.value.details()
                                                      or "not a directory" in refused.value.details())
    assert not (tmp_path / "escape").exists() and not (tmp_path / "out").exists()


def test_checkpoints_inside_the_root_are_saved_and_loaded(trainer):
    stub, root = trainer
    saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(path="run-1/step-000000"), timeout=60)
    assert saved.path == str((root / "run-1" / "step-000000").resolve())
    assert (root / "run-1" / "step-000000" / "config.json").exists()
    loaded = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=saved.path), timeout=60)  # absolute, inside
    assert loaded.step == saved.step


@pytest.mark.parametrize("header, accepted", [("Bearer s3cret", True), ("bearer s3cret", True), ("BEARER s3cret", True),
                                              ("Token s3cret", False), ("s3cret", False), ("Bearer s3cre", False),
                                              ("Bearer  s3cret", True)])
def test_grpc_and_rest_accept_the_same_bearer_spellings(tmp_path, header, accepted):
    from fastapi.testclient import TestClient

    from services.coordinator.jobs import JobManager
    from services.coordinator.rest import create_app
    from services.coordinator.server import build_server as build_coordinator_server
    from services.coordinator.store import MemoryJobStore
    from services.api import coordinator_pb2, coordinator_pb2_grpc

    manager = JobManager(lambda job: None, runs_dir=tmp_path, store=MemoryJobStore())
    rest = TestClient(create_app(manager, "s3cret")).get("/v1/jobs", headers={"Authorization": header})
    server = build_coordinator_server(manager, "127.0.0.1:0", token="s3cret")
    try:
        with channel(f"127.0.0.1:{server.port}") as ch:
            try:
                coordinator_pb2_grpc.CoordinatorStub(ch).ListJobs(coordinator_pb2.ListJobsRequest(), timeout=10,
                                                                  metadata=[("authorization", header)])
                grpc_ok = True
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED
                grpc_ok = False
    finally:
        server.stop(0)
        manager.close()
    assert (rest.status_code == 200, grpc_ok) == (accepted, accepted), (rest.status_code, grpc_ok)
