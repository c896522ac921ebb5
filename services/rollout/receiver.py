"""The engine's side of the data planes: receive every bucket into staging, verify, hand over.

Nothing here touches the model: each function returns verified flat buckets (for shm, views of
the trainer's locked segments), and the engine swaps them in afterwards.
Staging buffers are kept between syncs so a steady-state sync allocates nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from services.api import weights_pb2
from services.weights import cuda_ipc, fast_cuda, shm, staging
from services.weights.broadcast import WeightGroup
from services.weights.buckets import Manifest
from services.weights.fingerprint import IncrementalFingerprint
from services.weights.verify import verify_buckets

log = logging.getLogger("rlfleet.rollout")


class Staging:
    """Two sets of flat uint8 receive buffers (one buffer per bucket), used in turn.

    A verified set is adopted by the model as its weights (no copy), so the next update is
    received into the other set; each set is reused while the bucket sizes stay the same.

    Which set the model holds is tracked by index, never by the identity of the list a receiver
    hands back: receivers may return a copy of the list, and a wrong guess here means the next
    update is written straight into the weights being served."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sets: list[list[torch.Tensor]] = [[], []]
        self._adopted = 1  # the set the model holds; the next receive goes to the other one

    def buffers(self, manifest: Manifest) -> list[torch.Tensor]:
        """The set to receive into: never the one the model holds."""
        sizes = [b.nbytes for b in manifest.buckets]
        free = 1 - self._adopted
        if [b.numel() for b in self._sets[free]] != sizes:
            self._sets[free] = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        return list(self._sets[free])

    def adopted(self, buffers: Sequence[torch.Tensor], kept: bool = True) -> None:
        """The model has loaded `buffers` (the set `buffers()` gave). `kept`: it holds them as its
        weights from now on. Otherwise it copied or swapped their bytes in, and the set (then
        holding nothing the model uses) is the one to receive into next."""
        free = 1 - self._adopted
        if len(buffers) != len(self._sets[free]) or any(a is not b for a, b in zip(buffers, self._sets[free])):
            raise AssertionError("Staging.adopted: the buffers are not the set handed out for receiving")
        if kept:
            self._adopted = free

    def clear(self) -> None:
        """Free the set the model does not hold (the engine's weights are being released)."""
        self._sets[1 - self._adopted] = []


def receive_broadcast(group: WeightGroup, src: int, manifest: Manifest, staging: Staging) -> list[torch.Tensor]:
    """Receive every bucket, verifying what has arrived while the rest is in flight: host
    buckets are hashed part by part, device buckets fingerprinted on the GPU one by one."""
    buffers = staging.buffers(manifest)
    algo = manifest.fingerprint_algo
    if algo == "xxh3" and staging.device.type == "cpu":
        hashers = [IncrementalFingerprint(flat) for flat in buffers]
        group.broadcast_buckets(buffers, src, on_part=lambda k, n: hashers[k].filled(n))
        computed = [h.result() for h in hashers]
    elif algo == "fast" and all(fast_cuda.available(b) for b in buffers):
        queued = fast_cuda.Fingerprinter()

        def arrived(k: int, n: int) -> None:
            if n == buffers[k].numel():  # the whole bucket (gloo reports it in parts)
                queued.add(buffers[k])

        group.broadcast_buckets(buffers, src, on_part=arrived)
        computed = queued.results()
    else:
        group.broadcast_buckets(buffers, src)
        computed = None
    verify_buckets(manifest, buffers, computed=computed)
    return buffers


def receive_shm(reader: shm.ShmReader, source: weights_pb2.ShmSource, manifest: Manifest) -> list[torch.Tensor]:
    """Verified views of the trainer's segments, locked so the trainer cannot rewrite them: the
    engine adopts them as its weights, then calls `reader.adopted()` (or `reader.abandon()`)."""
    views = reader.open(list(source.segment_names), manifest)
    verify_buckets(manifest, views)
    return views


def receive_host_copy(reader: shm.ShmReader, source: weights_pb2.ShmSource, manifest: Manifest,
                      into: Staging) -> list[torch.Tensor]:
    """An offloaded trainer's host copy, in shared memory, copied into this engine's staging on
    its GPU and verified there (the mappings stay page-locked from sync to sync)."""
    device = into.device
    started = time.perf_counter()
    views = reader.open(list(source.segment_names), manifest, pinned=True)
    opened = time.perf_counter()
    try:
        buffers, prints = staging.upload_and_fingerprint(views, device, manifest.fingerprint_algo,
                                                         out=into.buffers(manifest))
        torch.cuda.current_stream(device).synchronize()  # the host pages may be rewritten once we return
    finally:
        reader.copied()
    uploaded = time.perf_counter()
    verify_buckets(manifest, buffers, computed=prints)
    log.debug("host copy of version %d: opening %.1f ms, uploading and fingerprinting %.1f ms (%.1f GB/s), "
              "verifying %.1f ms", manifest.version, 1e3 * (opened - started), 1e3 * (uploaded - opened),
              manifest.total_bytes / (uploaded - opened) / 1e9, 1e3 * (time.perf_counter() - uploaded))
    return buffers


def receive_cuda_ipc(source: weights_pb2.CudaIpcSource, manifest: Manifest, staging: Staging) -> list[torch.Tensor]:
    """Copy the trainer's buckets into staging and verify the copies. With "fast" fingerprints
    (and Triton) each bucket is fingerprinted by the copy itself, which reads it anyway."""
    started = time.perf_counter()
    handles = sorted(source.handles, key=lambda h: h.bucket)
    if [h.bucket for h in handles] != list(range(len(manifest.buckets))):
        raise ValueError(f"cuda_ipc.handles: expected one handle per bucket 0..{len(manifest.buckets) - 1}")
    views = _OpenedInTurn(handles, manifest)
    buffers = staging.buffers(manifest)
    if manifest.fingerprint_algo == "fast" and all(fast_cuda.available(b) for b in buffers):
        prints = fast_cuda.copy_and_fingerprint((flat, views[k]) for k, flat in enumerate(buffers))
    else:
        for k, flat in enumerate(buffers):
            flat.copy_(views[k])
        prints = None  # verify_buckets fingerprints the copies
    copied = time.perf_counter()
    verify_buckets(manifest, buffers, computed=prints)
    log.debug("cuda_ipc version %d: %d handles opened in %.2f ms, copying and fingerprinting %.2f ms in all, "
              "verifying %.2f ms", manifest.version, len(handles), 1e3 * views.opening_seconds,
              1e3 * (copied - started), 1e3 * (time.perf_counter() - copied))
    return buffers


class _OpenedInTurn(Sequence):
    """Views of the trainer's buckets, each opened when first read. Opening makes this stream wait
    for the bucket's own copy (its IPC event), so verifying bucket k runs while later buckets are
    still being staged host->device by an offloaded trainer."""

    def __init__(self, handles: list[weights_pb2.CudaIpcHandle], manifest: Manifest):
        self._handles, self._sizes = handles, [b.nbytes for b in manifest.buckets]
        self._views: dict[int, torch.Tensor] = {}
        self.opening_seconds = 0.0

    def __len__(self) -> int:
        return len(self._handles)

    def __getitem__(self, k: int) -> torch.Tensor:
        if not 0 <= k < len(self):
            raise IndexError(k)
        if k not in self._views:
            started = time.perf_counter()
            self._views[k] = cuda_ipc.open_handle(self._handles[k], self._sizes[k])
            self.opening_seconds += time.perf_counter() - started
        return self._views[k]
