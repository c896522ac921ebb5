"""Data planes between real processes: gloo broadcast to two engines, shared memory, gRPC stream;
each delivers bit-identical weights; an engine killed or stalled mid-transfer fails the sync within
its timeout while the trainer and the other engine stay usable, and the next sync succeeds."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from services.api import coordinator_pb2, rollout_pb2, trainer_pb2
from services.coordinator.clients import RolloutClient, TrainerClient
from services.coordinator.weight_sync import WeightSyncer, choose_plane
from services.launcher import LocalFleet
from services.api import weights_pb2
from tests.conftest import make_syncer, stop_fleet, stop_process
from tests.integration.conftest import run_job

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def two_engine_fleet(tmp_path_factory):
    local = LocalFleet(tmp_path_factory.mktemp("planes-logs"), env={"OMP_NUM_THREADS": "1"})
    try:
        trainer = local.start("trainer", "trainer-0", [])
        engines = [local.start("rollout", f"rollout-{i}", []) for i in range(2)]
        local.wait_ready()
        local.start(
            "coordinator", "coordinator",
            ["--trainers", trainer.address, "--rollouts", ",".join(e.address for e in engines), "--db", "memory"],
        )
        local.wait_ready()
        yield local
    finally:
        local.stop()


def _sha256_matches(trainer: TrainerClient, engine: RolloutClient, bucket_bytes: int) -> bool:
    manifest = trainer.weight_manifest("sha256")
    version, prints = engine.fingerprints("sha256", bucket_bytes)
    return version == manifest.version and prints == [b.fingerprint for b in manifest.buckets]


@pytest.mark.parametrize("plane", ["broadcast", "shm", "grpc_stream"])
def test_each_plane_delivers_bit_identical_weights_to_two_engines(two_engine_fleet, tiny_model_dir, task_files, tmp_path, plane):
    train, test = task_files
    job = textwrap.dedent(
        f"""
        name: plane-{plane}
        model: {tiny_model_dir}
        num_rollout: 2
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 4, samples_per_prompt: 2, num_engines: 2, sampling: {{max_new_tokens: 3}}}}
        data: {{train: {train}}}
        eval: {{every: 0, datasets: [{{name: heldout, path: {test}, limit: 4, sampling: {{max_new_tokens: 3}}}}]}}
        trainer: {{optimizer: {{lr: 0.01}}}}
        weight_sync: {{plane: {plane}, verify: exact, bucket_mb: 1}}
        """
    )
    children = {c.role: c for c in two_engine_fleet.children}
    final, events = run_job(children["coordinator"].address, job, timeout_s=120)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    import json

    syncs = [json.loads(e.data_json) for e in events if e.kind == "weight_sync"]
    assert len(syncs) == 3 and all(s["plane"] == plane and not s["failures"] for s in syncs)
    trainer = TrainerClient(children["trainer-0"].address)
    for name in ("rollout-0", "rollout-1"):
        assert _sha256_matches(trainer, RolloutClient(children[name].address), 1024 * 1024)


def test_impossible_forced_plane_names_the_engine():
    cpu = weights_pb2.Capabilities(host_id="a", broadcast_backends=["gloo"])
    other_host = weights_pb2.Capabilities(host_id="b", broadcast_backends=["gloo"])
    with pytest.raises(ValueError, match="cuda_ipc is impossible for engine e1: it shares no GPU"):
        choose_plane(cpu, cpu, "cuda_ipc", "e1")
    with pytest.raises(ValueError, match="shm is impossible for engine e2: it runs on another host"):
        choose_plane(cpu, other_host, "shm", "e2")
    assert choose_plane(cpu, cpu, "auto", "e") == "shm"
    assert choose_plane(cpu, other_host, "auto", "e") == "broadcast"
    gpu0 = weights_pb2.Capabilities(host_id="a", gpu_uuids=["GPU-0"])
    gpu1 = weights_pb2.Capabilities(host_id="a", gpu_uuids=["GPU-1"])
    assert choose_plane(gpu0, gpu0, "auto", "e") == "cuda_ipc"
    assert choose_plane(gpu0, gpu1, "auto", "e") == "broadcast"


def test_two_nccl_engines_on_one_gpu_are_refused_before_anything_moves():
    from types import SimpleNamespace

    gpu0 = weights_pb2.Capabilities(host_id="a", gpu_uuids=["GPU-0"])
    gpu1 = weights_pb2.Capabilities(host_id="a", gpu_uuids=["GPU-1"])
    gpu2 = weights_pb2.Capabilities(host_id="a", gpu_uuids=["GPU-2"])

    def syncer(*caps):
        engines = [SimpleNamespace(address=f"e{k}") for k in range(len(caps))]
        return WeightSyncer(trainer=SimpleNamespace(address="t"), engines=engines, trainer_caps=gpu0,
                            engine_caps=list(caps), forced="auto", exact=False, timeout_s=1.0, token="", pool=None)

    with pytest.raises(ValueError, match="engines e0 and e1 share GPU GPU-1, and NCCL refuses two ranks on one GPU"):
        syncer(gpu1, gpu1)
    assert syncer(gpu1, gpu2).planes == ["broadcast", "broadcast"]
    assert syncer(gpu0, gpu0, gpu1).planes == ["cuda_ipc", "cuda_ipc", "broadcast"]  # IPC engines may share


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory):
    """About 60 MB of weights: bigger than socket buffers, so a stopped receiver really stalls."""
    import torch

    from services.models import DecoderLM, ModelConfig, init_weights, make_char_tokenizer, save_hf_dir

    tokenizer = make_char_tokenizer("0123456789+-= ")
    config = ModelConfig(
        architecture="qwen3", vocab_size=tokenizer.vocab_size, hidden_size=1024, intermediate_size=2048,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = DecoderLM(config)
    init_weights(model, seed=0)
    directory = tmp_path_factory.mktemp("mid-model")
    save_hf_dir(model, config, directory)
    tokenizer.save(directory)
    return directory


def _configure_trainer(trainer: TrainerClient, model) -> None:
    trainer.configure(trainer_pb2.TrainerConfig(model_path=str(model), bucket_bytes=8 << 20,
                                                optimizer=trainer_pb2.OptimizerConfig(lr=1e-3)))


def _configure_engine(engine: RolloutClient, model) -> None:
    engine.configure(rollout_pb2.RolloutConfig(model_path=str(model), load_weights=True))


@dataclass
class _Faults:
    """A configured trainer and two engines (the mid-sized model), each its own process; engine 1
    is the one a test may kill or stall."""

    trainer: TrainerClient
    engines: list[RolloutClient]
    trainer_process: subprocess.Popen
    victim: subprocess.Popen


@dataclass
class _SharedPeers:
    """The trainer and engine 0, started and configured once for the module's fault tests. No test
    leaves them stopped (a stalled trainer is continued) and each test ends with a sync that
    reaches engine 0 again, as its own assertions check. Engine 0 takes every plane in turn, in
    the tests' order (broadcast with a peer killed, then shm, then grpc_stream): an engine that
    switched planes this way once reported the newest version while serving an older one's bytes,
    which the sha256 check after each test catches."""

    local: LocalFleet
    trainer: TrainerClient
    engine: RolloutClient

    @property
    def trainer_process(self) -> subprocess.Popen:
        return self.local.children[0].process


@pytest.fixture(scope="module")
def shared_peers(tmp_path_factory, mid_model):
    local = LocalFleet(tmp_path_factory.mktemp("faults-logs"), env={"OMP_NUM_THREADS": "1"})
    try:
        trainer = local.start("trainer", "trainer-0", [])
        engine = local.start("rollout", "rollout-0", [])
        local.wait_ready()
        peers = _SharedPeers(local, TrainerClient(trainer.address), RolloutClient(engine.address))
        with ThreadPoolExecutor(2) as pool:  # the two load the model side by side
            done = [pool.submit(_configure_trainer, peers.trainer, mid_model),
                    pool.submit(_configure_engine, peers.engine, mid_model)]
            for future in done:
                future.result()
        yield peers
    finally:
        stop_fleet(local)


def _client_of(configured, client_type):
    """A new client of a configured peer: what a test patches on it dies with the test."""
    client = client_type(configured.address)
    client.capabilities = configured.capabilities
    return client


@pytest.fixture
def faults(tmp_path, mid_model, shared_peers):
    """`faults()`: the shared trainer and engine 0, through clients of this test's own, and a fresh
    engine 1 for this test alone."""
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    clients: list = []

    def make() -> _Faults:
        assert all(c.process.poll() is None for c in shared_peers.local.children), \
            "an earlier test left a shared process dead"
        trainer = _client_of(shared_peers.trainer, TrainerClient)
        survivor = _client_of(shared_peers.engine, RolloutClient)
        clients.extend([trainer, survivor])
        victim = local.start("rollout", "rollout-1", [])
        local.wait_ready()
        clients.append(RolloutClient(victim.address))
        _configure_engine(clients[-1], mid_model)
        return _Faults(trainer, clients[-2:], shared_peers.trainer_process, victim.process)

    try:
        yield make
    finally:
        stop_fleet(local)  # a test may have stopped engine 1
        for client in clients:
            client.close()


@pytest.mark.parametrize("failure", ["killed", "stalled"])
def test_a_failing_engine_mid_broadcast_leaves_trainer_and_others_usable(faults, failure):
    fleet = faults()
    trainer, engines = fleet.trainer, fleet.engines
    pool = ThreadPoolExecutor(8)
    syncer = make_syncer(trainer, engines, pool, plane="broadcast", timeout_s=4.0)
    first = syncer.sync({0, 1})
    assert first.ok == {0, 1} and not first.failures
    trainer.train_step(trainer_pb2.Batch(samples=[trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5], advantage=1.0)]))

    victim = fleet.victim
    stop_process(victim.pid, failure)
    started = time.monotonic()
    broken = syncer.sync({0, 1})
    took = time.monotonic() - started
    assert 1 not in broken.ok and engines[1].address in broken.failures
    assert took < 4.0 + 10.0  # the configured timeout, plus slack for a loaded 2-core box
    print(f"{failure}: sync failed after {took:.1f}s: {broken.failures}")

    # the trainer is fine: it answers, trains, and serves the next sync
    assert trainer.status().configured
    trainer.train_step(trainer_pb2.Batch(samples=[trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5], advantage=1.0)]))
    if failure == "stalled":
        os.kill(victim.pid, signal.SIGKILL)
    again = syncer.sync({0})
    assert 0 in again.ok
    assert engines[1].address in again.failures  # dead: left out of the rebuilt group
    assert _sha256_matches(trainer, engines[0], 8 << 20)
    syncer.close()
    pool.shutdown()


@pytest.mark.parametrize("failure", ["killed", "stalled"])
@pytest.mark.parametrize("plane", ["shm", "grpc_stream"])
def test_an_engine_stopped_during_a_sync_leaves_trainer_and_others_usable(faults, plane, failure):
    """The engine is stopped 30 ms into the sync: reading the trainer's segments, or pulling its
    stream (the trainer then has a stream open to a peer that reads no more). Killed a second
    later, or left stalled: the sync fails for it within the timeout, the trainer trains on while
    it is still stalled, and the next sync reaches the other engine."""
    fleet = faults()
    trainer, engines = fleet.trainer, fleet.engines
    pool = ThreadPoolExecutor(8)
    syncer = make_syncer(trainer, engines, pool, plane=plane, timeout_s=4.0)
    sample = trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5], advantage=1.0)
    try:
        assert syncer.sync({0, 1}).ok == {0, 1}
        trainer.train_step(trainer_pb2.Batch(samples=[sample]))
        victim = fleet.victim
        stop_process(victim.pid, failure, after_s=0.03)
        started = time.monotonic()
        broken = syncer.sync({0, 1})
        took = time.monotonic() - started
        print(f"{plane}, {failure}: {took:.2f}s, failures {broken.failures}")
        assert 0 in broken.ok
        if 1 not in broken.ok:  # the timer may fire after a fast engine has finished
            assert engines[1].address in broken.failures
        assert took < 4.0 * 1.1 + 2 + 10.0  # the engine's deadline, plus slack for a loaded 2-core box

        trainer.train_step(trainer_pb2.Batch(samples=[sample]))  # returns: no stream holds the weights
        if failure == "stalled":
            os.kill(victim.pid, signal.SIGKILL)
        again = syncer.sync({0})
        assert 0 in again.ok
        assert engines[1].address in again.failures  # dead now
        assert _sha256_matches(trainer, engines[0], 8 << 20)
    finally:
        syncer.close()
        pool.shutdown()


def test_a_push_that_fails_at_once_does_not_hold_the_engines_until_their_timeout(faults):
    """The trainer refuses the push (here: asked for a version it has no manifest of) while the
    group itself is fine: the engines already waiting on the collective must be let go now, not
    at the sync timeout."""
    fleet = faults()
    trainer, engines = fleet.trainer, fleet.engines
    pool = ThreadPoolExecutor(8)
    try:
        syncer = make_syncer(trainer, engines, pool, plane="broadcast", timeout_s=60.0)
        assert not syncer.sync({0, 1}).failures
        real_push = trainer.push_weights
        trainer.push_weights = lambda plane, version, *a, **kw: real_push(plane, version + 999, *a, **kw)
        started = time.monotonic()
        broken = syncer.sync({0, 1})
        took = time.monotonic() - started
        assert trainer.address in broken.failures and "has no manifest" in broken.failures[trainer.address]
        assert took < 15.0, f"engines were held {took:.0f}s by a push that had already failed"
        trainer.push_weights = real_push
        again = syncer.sync({0, 1})  # a new group is formed
        assert again.ok == {0, 1} and not again.failures, again.failures
        assert all(_sha256_matches(trainer, e, 8 << 20) for e in engines)
        syncer.close()
    finally:
        pool.shutdown()


def test_a_trainer_stalled_mid_sync_fails_the_sync_within_the_timeout_and_recovers(faults):
    """The trainer is the peer that stalls: stopped once it has sent the manifest, so the engines
    are waiting in the broadcast and its push never comes. The sync fails within the sync's
    timeout (not the clients' ten-minute deadline) and names the trainer; once the trainer runs
    again, the next sync forms a new group and reaches both engines."""
    fleet = faults()
    trainer, engines = fleet.trainer, fleet.engines
    pool = ThreadPoolExecutor(8)
    syncer = make_syncer(trainer, engines, pool, plane="broadcast", timeout_s=4.0)
    pid = fleet.trainer_process.pid
    try:
        assert syncer.sync({0, 1}).ok == {0, 1}
        trainer.train_step(trainer_pb2.Batch(samples=[trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5], advantage=1.0)]))
        real_manifest = trainer.weight_manifest

        def manifest_then_stall(*args, **kwargs):
            manifest = real_manifest(*args, **kwargs)
            stop_process(pid, "stalled")
            return manifest

        trainer.weight_manifest = manifest_then_stall
        started = time.monotonic()
        broken = syncer.sync({0, 1})
        took = time.monotonic() - started
        print(f"stalled trainer: {took:.1f}s, failures {broken.failures}")
        assert not broken.ok and trainer.address in broken.failures
        assert "PushWeights" in broken.failures[trainer.address]
        assert took < 4.0 * 1.1 + 2 + 10.0  # the push's deadline, plus slack for a loaded 2-core box
        trainer.weight_manifest = real_manifest
        os.kill(pid, signal.SIGCONT)
        again = syncer.sync({0, 1})
        assert again.ok == {0, 1} and not again.failures, again.failures
        assert all(_sha256_matches(trainer, e, 8 << 20) for e in engines)
    finally:
        os.kill(pid, signal.SIGCONT)
        syncer.close()
        pool.shutdown()


def test_a_killed_trainer_leaves_nothing_in_dev_shm(tmp_path, tiny_model_dir):
    """Shm segments outlive nobody: the resource tracker unlinks them when the trainer is SIGKILLed."""
    from services.weights.shm import SHM_DIR

    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    pool = ThreadPoolExecutor(2)
    try:
        local.start("trainer", "trainer-0", [])
        local.start("rollout", "rollout-0", [])
        local.wait_ready()
        trainer, engine = TrainerClient(local.children[0].address), RolloutClient(local.children[1].address)
        _configure_trainer(trainer, tiny_model_dir)
        _configure_engine(engine, tiny_model_dir)
        syncer = make_syncer(trainer, [engine], pool, plane="shm", timeout_s=30.0)
        before = set(os.listdir(SHM_DIR))
        assert syncer.sync({0}).ok == {0}
        made = [n for n in set(os.listdir(SHM_DIR)) - before if n.startswith("rlfleet-")]
        assert made, "the sync wrote no shm segment"
        os.kill(local.children[0].process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any((SHM_DIR / n).exists() for n in made):
            time.sleep(0.1)
        assert not any((SHM_DIR / n).exists() for n in made)
    finally:
        pool.shutdown()
        local.stop()
