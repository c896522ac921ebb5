"""Packs the trainer's current weights into fingerprinted host buckets for the pull planes.

A snapshot is taken once per (weights version, fingerprint algorithm) and reused by every engine
that pulls that version, so all engines receive exactly the bytes the manifest describes even if
training moves on while a slow engine is still reading.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import torch

from services.weights.apply import named_weights
from services.weights.buckets import Manifest, pack_bucket, plan_buckets
from services.weights.fingerprint import fingerprint

DEFAULT_FINGERPRINT = "fast"


@dataclass(frozen=True)
class Snapshot:
    manifest: Manifest
    buffers: list[torch.Tensor]  # flat uint8 CPU tensors, one per bucket


class WeightSource:
    def __init__(self, bucket_bytes: int):
        self._bucket_bytes = bucket_bytes
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._key: tuple[int, str] | None = None

    def snapshot(self, module: torch.nn.Module, version: int, algo: str = "", source: str = "gpu") -> Snapshot:
        algo = algo or DEFAULT_FINGERPRINT
        with self._lock:
            if self._key != (version, algo):
                self._snapshot = self._take(module, version, algo, source)
                self._key = (version, algo)
            return self._snapshot

    def current(self, version: int) -> Snapshot | None:
        with self._lock:
            if self._snapshot is not None and self._snapshot.manifest.version == version:
                return self._snapshot
            return None

    def _take(self, module: torch.nn.Module, version: int, algo: str, source: str) -> Snapshot:
        named = named_weights(module)
        tensors = dict(named)
        buckets, buffers = [], []
        with torch.no_grad():
            for spec in plan_buckets(named, self._bucket_bytes):
                flat = pack_bucket(spec, tensors).cpu()
                buffers.append(flat)
                buckets.append(dataclasses.replace(spec, fingerprint=fingerprint(flat, algo)))
        manifest = Manifest(version=version, source=source, buckets=tuple(buckets), fingerprint_algo=algo)
        return Snapshot(manifest, buffers)
