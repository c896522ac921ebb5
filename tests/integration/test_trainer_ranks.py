"""Two torch trainer processes are one model (gloo, data parallel): the step they take together
equals the step one trainer takes on the same batch, both sleep, and a rank that dies fails the
step on the other instead of holding it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from services.api import trainer_pb2
from services.coordinator.clients import PeerError, TrainerClient, TrainerGroup
from services.launcher import LocalFleet
from services.weights.grpc_stream import receive
from services.weights.manifest import manifest_from_proto

pytestmark = pytest.mark.faults


def _trainer_processes(tmp_path, count: int):
    """`count` trainer processes and their clients; any a test stopped is continued so it can exit."""
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    try:
        children = [local.start("trainer", f"trainer-{i}", []) for i in range(count)]
        local.wait_ready()
        yield local, [TrainerClient(c.address, deadline_s=120) for c in children]
    finally:
        for child in local.children:
            try:
                os.kill(child.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        local.stop()


@pytest.fixture
def trainers(tmp_path):
    """Three trainer processes: two to form a group, one to train alone."""
    yield from _trainer_processes(tmp_path, 3)


@pytest.fixture
def two_trainers(tmp_path):
    """Two trainer processes, to form a group."""
    yield from _trainer_processes(tmp_path, 2)


def _config(model_dir) -> trainer_pb2.TrainerConfig:
    return trainer_pb2.TrainerConfig(
        model_path=str(model_dir), seed=3, micro_batch_size=2, bucket_bytes=1 << 20,
        optimizer=trainer_pb2.OptimizerConfig(lr=1e-2, grad_clip=1.0), offload=True,
    )


def _batch(num: int) -> trainer_pb2.Batch:
    gen = torch.Generator().manual_seed(7)
    samples = []
    for i in range(num):  # uneven lengths, so the shards carry different token counts
        prompt = torch.randint(3, 14, (3 + i % 4,), generator=gen).tolist()
        response = torch.randint(3, 14, (2 + (i * 5) % 7,), generator=gen).tolist()
        advantages = (torch.randn(len(response), generator=gen)).tolist()
        samples.append(trainer_pb2.Sample(prompt_ids=prompt, response_ids=response, advantages=advantages,
                                          old_logprobs=[-2.5] * len(response)))
    return trainer_pb2.Batch(samples=samples)


def _weights(client: TrainerClient) -> dict[int, torch.Tensor]:
    manifest_proto = client.weight_manifest("sha256")
    manifest = manifest_from_proto(manifest_proto)
    chunks = client._stub.GetWeights(trainer_pb2.GetWeightsRequest(version=manifest.version), timeout=60)
    return receive(chunks, manifest)


def _assert_close(a: list[list[float]], b: list[list[float]]) -> None:
    assert [len(row) for row in a] == [len(row) for row in b]
    assert torch.allclose(torch.tensor(sum(a, [])), torch.tensor(sum(b, [])), atol=1e-5)


def test_two_ranks_take_the_step_one_rank_takes(trainers, tiny_model_dir):
    _, (rank0, rank1, alone) = trainers
    group = TrainerGroup([rank0, rank1], timeout_s=60)
    status = group.configure(_config(tiny_model_dir))
    assert (status.rank, status.world_size) == (0, 2)
    alone.configure(_config(tiny_model_dir))

    batch = _batch(5)  # 3 samples on rank 0, 2 on rank 1
    _assert_close(group.compute_logprobs("", batch), alone.compute_logprobs("", batch))
    together, version = group.train_step(batch)
    single, _ = alone.train_step(batch)
    assert version == 1
    for key in ("loss", "pg_loss", "grad_norm"):
        assert together[key] == pytest.approx(single[key], rel=1e-5, abs=1e-6), key

    # Both ranks applied the same update: rank 1's logprobs are part of the next answer, and
    # rank 0 (the weight source) serves weights equal to the lone trainer's.
    _assert_close(group.compute_logprobs("", batch), alone.compute_logprobs("", batch))
    group_weights, alone_weights = _weights(rank0), _weights(alone)
    for a, b in zip(group_weights, alone_weights):
        assert torch.allclose(a.view(torch.float32), b.view(torch.float32), atol=1e-6)

    # Every rank sleeps: weights and optimizer state leave both.
    group.sleep()
    for client in (rank0, rank1):
        life = client.status().lifecycle
        assert life.asleep and life.gpu_bytes_in_use == 0 and life.host_backup_bytes > 0, client.address
    with pytest.raises(PeerError, match="not the weight source"):
        rank1.weight_manifest()


def test_a_rank_that_dies_mid_step_fails_the_step_and_frees_the_other(two_trainers, tiny_model_dir):
    local, (rank0, rank1) = two_trainers
    group = TrainerGroup([rank0, rank1], timeout_s=10)
    group.configure(_config(tiny_model_dir))
    os.kill(local.children[1].process.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(PeerError) as info:
        group.train_step(_batch(4))
    assert info.value.peer in (rank0.address, rank1.address)
    assert time.monotonic() - started < 60
    # rank 0 gave up on its collective and answers again; its weights did not move
    assert rank0.status().step == 0


def test_a_rank_whose_peer_never_comes_answers_meanwhile_and_fails_in_the_timeout(two_trainers, tiny_model_dir):
    import threading

    _, (rank0, rank1) = two_trainers
    port = rank0.open_rank_group(2, timeout_s=30)
    config = _config(tiny_model_dir)
    config.ranks.CopyFrom(trainer_pb2.RankGroup(rank=1, world_size=2, address=f"127.0.0.1:{port}", timeout_s=4))
    outcome = {}
    joining = threading.Thread(target=lambda: outcome.update(error=_error(lambda: rank1.configure(config))))
    started = time.monotonic()
    joining.start()
    time.sleep(1.0)
    assert not rank1.status().configured  # answered while the join waits for rank 0
    with pytest.raises(PeerError, match="another Configure"):
        rank1.configure(_config(tiny_model_dir))
    joining.join(60)
    error = outcome["error"]
    assert error is not None and error.code.name == "UNAVAILABLE" and "rank 1 of 2" in error.details
    assert time.monotonic() - started < 30
    rank1.configure(_config(tiny_model_dir))  # alone, it works again
    assert rank1.status().configured


def _error(call):
    try:
        call()
    except PeerError as e:
        return e
    return None


def test_fixed_store_ports_are_the_ones_used(tiny_model_dir):
    """Ports a NetworkPolicy can name: rank 0's rendezvous store and the weight-sync store."""
    from services.trainer.server import build_server
    from services.weights.broadcast import free_port

    rank_port, weight_port = free_port(), free_port()
    server = build_server("127.0.0.1:0", rank_store_port=rank_port, weight_store_port=weight_port)
    try:
        client = TrainerClient(f"127.0.0.1:{server.port}")
        assert client.open_rank_group(2, timeout_s=10) == rank_port
        assert client.open_rank_group(2, timeout_s=10) == rank_port  # asked again: the old store let it go
        client.configure(_config(tiny_model_dir))
        assert client.init_weight_update_group("g", 1, "gloo", timeout_s=5) == weight_port  # alone: formed at once
        client.destroy_weight_update_group("g")
    finally:
        server.stop(0)
