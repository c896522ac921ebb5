"""Serves the trainer's weights to the pull planes as fingerprinted buckets.

A snapshot is taken once per (weights version, source, fingerprint algorithm) and reused by every
engine that pulls that version, so all engines receive exactly the bytes the manifest describes.
When the sync reads the host store, the snapshot *is* the host actor copy's buckets (no packing,
no copy); when it reads live weights, they are packed into host buckets once.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

from services.trainer.host_store import HostCopy
from services.weights.buckets import BucketSpec, Manifest, pack_bucket, plan_buckets
from services.weights.fingerprint import default_algo, fingerprint



@dataclass(frozen=True)
class Snapshot:
    manifest: Manifest
    buffers: list[torch.Tensor]  # flat uint8 CPU tensors, one per bucket


class WeightSource:
    def __init__(self, bucket_bytes: int):
        self._bucket_bytes = bucket_bytes
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._key: tuple | None = None

    def snapshot(
        self,
        weights: HostCopy | dict[str, torch.Tensor],
        layout: list[BucketSpec] | None,
        version: int,
        source: str,
        algo: str = "",
    ) -> Snapshot:
        """`weights` is a host copy laid out as `layout`, or live named tensors (layout None)."""
        key = (version, source, algo)
        with self._lock:
            if self._key != key:
                if isinstance(weights, HostCopy):
                    specs, buffers = layout, weights.buffers
                else:
                    specs = plan_buckets(list(weights.items()), self._bucket_bytes)
                    with torch.no_grad():
                        buffers = [pack_bucket(spec, weights).cpu() for spec in specs]
                used = algo or default_algo(buffers[0].device if buffers else "cpu")
                buckets = tuple(dataclasses.replace(s, fingerprint=fingerprint(b, used)) for s, b in zip(specs, buffers))
                manifest = Manifest(version=version, source=source, buckets=buckets, fingerprint_algo=used)
                self._snapshot, self._key = Snapshot(manifest, buffers), key
            return self._snapshot

    def current(self, version: int) -> Snapshot | None:
        with self._lock:
            if self._snapshot is not None and self._snapshot.manifest.version == version:
                return self._snapshot
            return None
