"""Host->device staging for syncs from an offloaded trainer: double-buffered slots that a slow
send must not see overwritten, and per-bucket IPC events an engine waits on."""

from __future__ import annotations

import contextlib

import pytest
import torch

from services.weights.fingerprint import fingerprint
from services.weights.staging import stage_and_send, stage_for_ipc

pytestmark = pytest.mark.gpu

SIZES = [3 << 20, 8 << 20, 1 << 20, 8 << 20, 5 << 20, 7]


def _host_buckets() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).pin_memory() for n in SIZES]


@pytest.mark.parametrize("kernel", [True, False], ids=["sms", "copy-engines"])
def test_a_slow_send_gets_every_bucket_intact_from_two_slots(kernel):
    device = torch.device("cuda")
    host = _host_buckets()
    received = [torch.zeros(n, dtype=torch.uint8, device=device) for n in SIZES]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    peak = []

    def send(k: int, slot: torch.Tensor) -> None:
        torch.cuda._sleep(20_000_000)  # a send that is much slower than the copies behind it
        received[k].copy_(slot)
        peak.append(torch.cuda.memory_allocated(device) - before)

    stage_and_send(host, device, send, kernel=kernel)
    torch.cuda.synchronize()
    for k, (h, r) in enumerate(zip(host, received)):
        assert torch.equal(h, r.cpu()), f"bucket {k} was overwritten before its send read it"
    assert max(peak) <= 2 * max(SIZES) + (1 << 20)  # two slots, not the whole model


_OPENER = """
import sys
from services.api import weights_pb2
from services.weights import cuda_ipc
from services.weights.fingerprint import fingerprint
source = weights_pb2.CudaIpcSource.FromString(sys.stdin.buffer.read())
sizes = [int(n) for n in sys.argv[1:]]
for handle, n in zip(source.handles, sizes):  # each open waits for that bucket's copy (its event)
    print(fingerprint(cuda_ipc.open_handle(handle, n), "fast"), flush=True)
"""


def test_ipc_staging_exports_one_event_per_bucket_behind_its_copy():
    """Another process opens every bucket right away, while the copies may still be running."""
    import subprocess
    import sys

    from services.api import weights_pb2

    device = torch.device("cuda")
    host = _host_buckets()
    buffers, handles = stage_for_ipc(host, device)
    assert [h.bucket for h in handles] == list(range(len(SIZES)))
    assert all(h.event_sync_required and h.event_handle for h in handles)
    assert len({bytes(h.event_handle) for h in handles}) == len(SIZES)  # an event each
    opened = subprocess.run(
        [sys.executable, "-c", _OPENER, *map(str, SIZES)],
        input=weights_pb2.CudaIpcSource(handles=handles).SerializeToString(),
        capture_output=True, check=True, timeout=120,
    )
    assert opened.stdout.decode().split() == [fingerprint(h, "fast") for h in host]
    del buffers


def test_a_failed_page_lock_is_named_and_leaves_cuda_usable():
    """A second cudaHostRegister of the same range fails; the error is ours to report, and must not
    surface later as the failure of some unrelated kernel."""
    from services.weights import shm
    from services.weights.errors import WeightSyncError

    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    shm.pin(buf)
    try:
        with pytest.raises(WeightSyncError, match="cudaHostRegister of 1048576 bytes failed"):
            shm.pin(buf)
        x = torch.ones(10, device="cuda")
        assert (x * 2).sum().item() == 20
    finally:
        shm.unpin(buf)


@contextlib.contextmanager
def _sleeping_trainer_with_a_group(tmp_path):
    """An offloaded trainer on the GPU, its WeightPusher and a one-rank NCCL group "g" (the only
    group NCCL allows on one GPU), all closed afterwards."""
    from services.api import weights_pb2
    from services.trainer.settings import TrainerSettings
    from services.trainer.torch_backend import TorchTrainer
    from services.trainer.weight_push import WeightPusher
    from tests.conftest import make_tiny_model

    trainer = TorchTrainer(TrainerSettings(model_path=str(make_tiny_model(tmp_path / "m")), device="cuda",
                                           offload=True, bucket_bytes=16 << 10))
    pusher = WeightPusher(trainer)
    try:
        pusher.init_group(weights_pb2.InitWeightUpdateGroupRequest(
            group_name="g", world_size=1, backend="nccl", master_address="127.0.0.1"))
        yield trainer, pusher
    finally:
        pusher.close()
        trainer.close()


def _push(pusher, version: int) -> None:
    from services.api import trainer_pb2, weights_pb2
    from services.trainer.weight_push import BROADCAST

    pusher.push(trainer_pb2.PushWeightsRequest(plane=BROADCAST, version=version,
                                               broadcast=weights_pb2.BroadcastSource(group_name="g")))


def test_an_nccl_push_from_a_sleeping_trainer_sends_each_bucket_from_a_staged_slot(tmp_path):
    """The real NCCL path of PushWeights on one GPU. Each slot is fingerprinted right after its
    broadcast, before it can be refilled."""
    from services.trainer.weight_push import BROADCAST

    with _sleeping_trainer_with_a_group(tmp_path) as (trainer, pusher):
        trainer.sleep()
        manifest = pusher.manifest(BROADCAST)
        assert manifest.source == "host" and len(manifest.buckets) > 2
        group, sent = pusher.groups["g"], []
        broadcast = group.broadcast_bucket

        def watched(flat, src=0, on_part=None):
            assert flat.device.type == "cuda"  # a device slot, not the host copy
            broadcast(flat, src=src, on_part=on_part)
            sent.append(fingerprint(flat, "fast"))

        group.broadcast_bucket = watched
        _push(pusher, manifest.version)
        assert sent == [b.fingerprint for b in manifest.buckets]


def test_fingerprints_captured_at_sleep_match_the_host_copy_after_a_push_from_it(tmp_path):
    """Sleep fingerprints the device buckets whole, gaps between tensors included, and a sync
    from the host copy is verified against those fingerprints. A push from the host copy leaves
    its staging slots' bytes in memory that the next wake may be handed back for the weights;
    before wake zeroed that memory, the captured fingerprint of a bucket with gaps stopped
    matching the host copy from the second sync on (an NCCL engine then refused every update)."""
    from services.trainer.batch import Sample
    from services.trainer.weight_push import BROADCAST
    from services.weights.fingerprint import fingerprints

    with _sleeping_trainer_with_a_group(tmp_path) as (trainer, pusher):
        for _ in range(3):
            trainer.train_step([Sample(prompt_ids=[3, 4], response_ids=[5], advantages=[1.0])])
            trainer.sleep()
            host = trainer.store.get("actor")
            assert host.fingerprints["fast"] == fingerprints(list(host.buffers), "fast")  # the host bytes, on the CPU
            _push(pusher, pusher.manifest(BROADCAST).version)
