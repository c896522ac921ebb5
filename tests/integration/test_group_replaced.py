"""A broadcast group destroyed or replaced while an update still waits on it. After a failed sync
the coordinator destroys the group on every member, and may form a new one, while a stalled
engine's update still sits in the old group's collective. That update must fail with a typed
error (ABORTED), and must not take a new group of the same name down with it: the next sync, over
the new group, delivers."""

from __future__ import annotations

import threading
import time

import pytest

import grpc
import torch

from services.api import rollout_pb2, weights_pb2
from services.coordinator.clients import PeerError, RolloutClient
from services.models.checkpoint import load_config
from services.models.decoder import DecoderLM, init_weights
from services.launcher import LocalFleet
from services.weights.apply import named_weights
from services.weights.broadcast import WeightGroup, _forget, free_port
from services.weights.buckets import pack_bucket, plan_buckets
from services.weights.manifest import make_manifest, manifest_to_proto


GROUP_TIMEOUT_S = 4.0  # a collective with no peer fails after this long


def _rank0(name: str, engine: RolloutClient) -> WeightGroup:
    """The trainer's side of a two-rank group that the engine joins as rank 1."""
    port = free_port()
    group = WeightGroup(master_address="127.0.0.1", master_port=port, rank=0, world_size=2, group_name=name,
                        backend="gloo", timeout_s=20, device=torch.device("cpu"))
    joined = threading.Thread(target=engine.init_weight_update_group,
                              args=("127.0.0.1", port, 1, 2, name, "gloo", GROUP_TIMEOUT_S))
    joined.start()
    group.connect()
    joined.join()
    return group


@pytest.fixture
def engine(tmp_path, tiny_model_dir):
    """An engine in a process of its own (torch registers a group's name once per process)."""
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    try:
        child = local.start("rollout", "rollout-0", [])
        local.wait_ready()
        client = RolloutClient(child.address)
        client.configure(rollout_pb2.RolloutConfig(model_path=str(tiny_model_dir), load_weights=True))
        yield client
        client.close()
    finally:
        local.stop()


def _update(tiny_model_dir, version: int):
    """A manifest of new weights, and their buckets."""
    model = DecoderLM(load_config(tiny_model_dir))
    init_weights(model, seed=version)
    weights = {name: t.detach().clone() for name, t in named_weights(model)}
    buckets = plan_buckets(list(weights.items()), 64 << 10)
    flats = [pack_bucket(b, weights) for b in buckets]
    return manifest_to_proto(make_manifest(version, "gpu", buckets, flats, "xxh3")), flats


def _stale_update(engine: RolloutClient, manifest, end_the_group) -> PeerError:
    """An update waiting on group "sync" (whose push never comes), failed by `end_the_group()`."""
    errors: list[BaseException] = []
    source = weights_pb2.BroadcastSource(group_name="sync", src_rank=0)
    waiting = threading.Thread(
        target=lambda: _record(errors, lambda: engine.update_weights(manifest, timeout_s=5, broadcast=source)))
    waiting.start()
    time.sleep(1.0)  # for the update to reach the collective (it fails only after GROUP_TIMEOUT_S)
    end_the_group()
    waiting.join(30)
    assert not waiting.is_alive() and len(errors) == 1 and isinstance(errors[0], PeerError), errors
    return errors[0]


def _deliver(engine: RolloutClient, group: WeightGroup, manifest, flats) -> None:
    pushed = threading.Thread(target=group.broadcast_buckets, args=(flats,))
    pushed.start()
    source = weights_pb2.BroadcastSource(group_name="sync", src_rank=0)
    assert engine.update_weights(manifest, timeout_s=20, exact=True, broadcast=source).version == manifest.version
    pushed.join()
    assert engine.fingerprints("xxh3", 64 << 10) == (manifest.version, [b.fingerprint for b in manifest.buckets])


def test_an_update_whose_group_is_destroyed_fails_typed_and_the_next_group_delivers(engine, tiny_model_dir, request):
    manifest, flats = _update(tiny_model_dir, 1)
    old = _rank0("sync", engine)
    request.addfinalizer(lambda: old.close(wait_s=1))
    destroyed: list[float] = []

    def destroy() -> None:
        started = time.monotonic()
        engine.destroy_weight_update_group("sync")
        destroyed.append(time.monotonic() - started)

    failed = _stale_update(engine, manifest, destroy)
    assert failed.code == grpc.StatusCode.ABORTED and "timed out" in failed.details, failed
    assert destroyed[0] < GROUP_TIMEOUT_S, "Destroy was held until the stale collective ended"
    old.close(wait_s=1)
    new = _rank0("sync", engine)
    try:
        _deliver(engine, new, manifest, flats)
    finally:
        new.close(wait_s=1)


def test_a_stale_update_leaves_the_new_group_of_its_name_working(engine, tiny_model_dir, request):
    manifest, flats = _update(tiny_model_dir, 2)
    old = _rank0("sync", engine)
    replaced: list[WeightGroup] = []

    def replace() -> None:
        _forget(old._pg)  # the trainer's side lets the name go, and never pushes on the old group
        replaced.append(_rank0("sync", engine))

    request.addfinalizer(lambda: [g.close(wait_s=1) for g in (old, *replaced)])
    failed = _stale_update(engine, manifest, replace)
    assert failed.code == grpc.StatusCode.ABORTED, failed
    _deliver(engine, replaced[0], manifest, flats)


def _record(errors: list, call) -> None:
    try:
        call()
    except BaseException as e:  # noqa: BLE001 (the test inspects it)
        errors.append(e)
