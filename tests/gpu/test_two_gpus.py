"""Two GPUs: a trainer on GPU 0 and an engine on GPU 1, weights moved by an NCCL broadcast (the
seed's disaggregated case). Every sync must leave the engine with exactly the trainer's bytes,
from live weights and from a sleeping trainer's host copy, beside an engine that shares the
trainer's GPU (CUDA IPC) in the same sync; an engine that dies or stalls during the broadcast
fails the sync for itself only, and the trainer trains on."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.api import rollout_pb2, trainer_pb2
from services.coordinator.clients import RolloutClient, TrainerClient
from services.launcher import LocalFleet
from tests.conftest import make_syncer, make_tiny_model, stop_fleet, stop_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
SAMPLE = trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5], advantage=1.0)


@pytest.fixture
def fleet(tmp_path):
    """A trainer and two engines, each its own process; tests place them on GPUs at Configure."""
    local = LocalFleet(tmp_path / "logs")
    try:
        local.start("trainer", "trainer-0", [])
        local.start("rollout", "rollout-0", [])
        local.start("rollout", "rollout-1", [])
        local.wait_ready(timeout_s=180)
        yield local, TrainerClient(local.children[0].address), [RolloutClient(c.address) for c in local.children[1:]]
    finally:
        stop_fleet(local, log_lines=25)  # a test may have stopped one; the logs show when one fails


def _configure(trainer, engines, devices, model, *, offload, bucket_bytes=16 << 10):
    trainer.configure(trainer_pb2.TrainerConfig(model_path=str(model), device="cuda:0", offload=offload,
                                                bucket_bytes=bucket_bytes,
                                                optimizer=trainer_pb2.OptimizerConfig(lr=1e-2)))
    for engine, device in zip(engines, devices):
        # scrambled weights: only a sync that delivers every byte can make them match the trainer's
        engine.configure(rollout_pb2.RolloutConfig(model_path=str(model), device=device, load_weights=False, seed=7))


def _matches(trainer, engine, bucket_bytes) -> bool:
    manifest = trainer.weight_manifest("sha256")
    version, prints = engine.fingerprints("sha256", bucket_bytes)
    return version == manifest.version and prints == [b.fingerprint for b in manifest.buckets]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fingerprint"])
@pytest.mark.parametrize("offload", [False, True], ids=["live", "asleep"])
def test_an_nccl_sync_from_gpu_0_to_gpu_1_is_bit_exact(fleet, tmp_path, offload, exact):
    _, trainer, engines = fleet
    engine = engines[0]
    model = make_tiny_model(tmp_path / "model")
    _configure(trainer, [engine], ["cuda:1"], model, offload=offload)
    assert not _matches(trainer, engine, 16 << 10)  # the scrambled start
    pool = ThreadPoolExecutor(4)
    syncer = make_syncer(trainer, [engine], pool, exact=exact, timeout_s=60.0)
    try:
        assert syncer.planes == ["broadcast"]
        groups = set()
        for step in (1, 2, 3):
            trainer.train_step(trainer_pb2.Batch(samples=[SAMPLE]))
            if offload:
                assert trainer.sleep().asleep
            result = syncer.sync({0})
            assert result.ok == {0} and not result.failures, result.failures
            assert result.source == ("host" if offload else "gpu")
            groups.add(syncer._group.name)
            assert _matches(trainer, engine, 16 << 10)
            generated = engine.generate(["1+2="], rollout_pb2.SamplingParams(max_new_tokens=3))
            assert generated[0].weight_version == step  # serving the new weights
        assert len(groups) == 1  # the NCCL group is built once and reused
    finally:
        syncer.close()
        pool.shutdown()


def test_one_sync_reaches_an_engine_beside_the_trainer_and_one_on_the_other_gpu(fleet, tmp_path):
    _, trainer, engines = fleet
    model = make_tiny_model(tmp_path / "model")
    _configure(trainer, engines, ["cuda:0", "cuda:1"], model, offload=True)
    pool = ThreadPoolExecutor(4)
    syncer = make_syncer(trainer, engines, pool, timeout_s=60.0)
    try:
        assert syncer.planes == ["cuda_ipc", "broadcast"]
        for _ in range(2):
            trainer.train_step(trainer_pb2.Batch(samples=[SAMPLE]))
            trainer.sleep()
            result = syncer.sync({0, 1})
            assert result.ok == {0, 1} and not result.failures, result.failures
            assert all(_matches(trainer, e, 16 << 10) for e in engines)
    finally:
        syncer.close()
        pool.shutdown()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("failure", ["killed", "stalled"])
def test_an_engine_lost_during_an_nccl_broadcast_fails_alone_and_the_trainer_trains_on(fleet, tmp_path, failure):
    """The engine on GPU 1 is stopped with its group cached, so the trainer's broadcast starts and
    finds no receiver; killed a second later, or left stalled. Its sync fails within the timeout,
    the engine on GPU 0 gets the weights, the trainer (whose GPU ran the broken collective) trains
    on, and the next sync reaches the engine that is left. (On a two-H200 machine the stalled case
    has been seen not to finish within 90 s; not yet diagnosed.)"""
    from bench.weight_sync import make_model

    begun = time.monotonic()

    def phase(what: str) -> None:  # printed as it happens: a timeout shows where the test stood
        print(f"{time.monotonic() - begun:6.1f}s {what}", flush=True)

    local, trainer, engines = fleet
    model = tmp_path / "model"
    make_model(model, 600)  # more than NCCL's per-channel buffers can take in without a receiver
    _configure(trainer, engines, ["cuda:0", "cuda:1"], model, offload=False, bucket_bytes=64 << 20)
    pool = ThreadPoolExecutor(8)
    syncer = make_syncer(trainer, engines, pool, timeout_s=10.0)
    try:
        phase("configured")
        assert syncer.sync({0, 1}).ok == {0, 1}
        trainer.train_step(trainer_pb2.Batch(samples=[SAMPLE]))
        phase("first sync and a step done; stopping the engine on GPU 1")
        victim = local.children[2].process
        stop_process(victim.pid, failure)
        started = time.monotonic()
        broken = syncer.sync({0, 1})
        took = time.monotonic() - started
        phase(f"{failure}: sync returned after {took:.1f}s, failures {broken.failures}")
        assert broken.ok == {0} and engines[1].address in broken.failures
        assert took < 10.0 + 30.0  # the timeout, plus NCCL's abort

        trainer.train_step(trainer_pb2.Batch(samples=[SAMPLE]))  # the trainer's GPU is usable
        phase("the trainer trained on")
        if failure == "stalled":
            os.kill(victim.pid, signal.SIGKILL)
        again = syncer.sync({0})
        phase(f"next sync: ok {again.ok}, failures {again.failures}")
        assert again.ok == {0} and engines[1].address in again.failures  # dead: left out of the group
        assert _matches(trainer, engines[0], 64 << 20)
    finally:
        syncer.close()
        pool.shutdown()
