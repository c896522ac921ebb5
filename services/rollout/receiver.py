"""The engine's side of the data planes: receive every bucket into staging, verify, hand over.

Nothing here touches the model: each function returns verified flat buckets (or, for shm, views
of verified segments valid inside a `with` block), and the engine swaps them in afterwards.
Staging buffers are kept between syncs so a steady-state sync allocates nothing.
"""

from __future__ import annotations

import torch

from services.api import weights_pb2
from services.weights import cuda_ipc, shm
from services.weights.broadcast import WeightGroup
from services.weights.buckets import Manifest
from services.weights.verify import verify_buckets


class Staging:
    """Flat uint8 receive buffers, one per bucket, reused while sizes stay the same."""

    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: list[torch.Tensor] = []

    def buffers(self, manifest: Manifest) -> list[torch.Tensor]:
        sizes = [b.nbytes for b in manifest.buckets]
        if [b.numel() for b in self._buffers] != sizes:
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
        return self._buffers


def receive_broadcast(group: WeightGroup, src: int, manifest: Manifest, staging: Staging) -> list[torch.Tensor]:
    buffers = staging.buffers(manifest)
    for flat in buffers:
        group.broadcast(flat, src=src)
    verify_buckets(manifest, buffers)
    return buffers


def receive_shm(reader: shm.ShmReader, source: weights_pb2.ShmSource, manifest: Manifest) -> list[torch.Tensor]:
    """Verified views of the trainer's segments; the engine copies from them right away."""
    views = reader.views(list(source.segment_names), manifest)
    verify_buckets(manifest, views)
    return views


def receive_cuda_ipc(source: weights_pb2.CudaIpcSource, manifest: Manifest) -> list[torch.Tensor]:
    handles = sorted(source.handles, key=lambda h: h.bucket)
    if [h.bucket for h in handles] != list(range(len(manifest.buckets))):
        raise ValueError(f"cuda_ipc.handles: expected one handle per bucket 0..{len(manifest.buckets) - 1}")
    views = [cuda_ipc.open_handle(h, b.nbytes) for h, b in zip(handles, manifest.buckets)]
    verify_buckets(manifest, views)
    return views
