"""The shared-memory plane: buckets in POSIX shared memory, for CPU processes on one host.

The trainer keeps one segment per bucket and reuses them from sync to sync (new segments only
when a bucket's size changes), writes the buckets there and hands the segment names to the
engines, which verify and copy straight from the mapped segments. Only names cross the socket.
"""

from __future__ import annotations

import contextlib
import secrets
from multiprocessing import resource_tracker, shared_memory
from typing import Iterator

import torch

from services.weights.buckets import Manifest
from services.weights.errors import WeightSyncError


class ShmWriter:
    """Trainer side: owns the segments (and unlinks them on close)."""

    def __init__(self, prefix: str = "rlfleet"):
        self._prefix = prefix
        self._segments: list[shared_memory.SharedMemory] = []
        self._views: list[torch.Tensor] = []

    def buffers(self, sizes: list[int]) -> list[torch.Tensor]:
        """Writable flat uint8 tensors over one segment per bucket, sized as asked."""
        if [v.numel() for v in self._views] != sizes:
            self.close()
            for size in sizes:
                segment = shared_memory.SharedMemory(
                    name=f"{self._prefix}-{secrets.token_hex(8)}", create=True, size=max(size, 1)
                )
                self._segments.append(segment)
                self._views.append(torch.frombuffer(segment.buf, dtype=torch.uint8, count=size) if size else torch.empty(0, dtype=torch.uint8))
        return self._views

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._segments]

    def close(self) -> None:
        self._views = []
        for segment in self._segments:
            segment.close()
            segment.unlink()
        self._segments = []


@contextlib.contextmanager
def attach(names: list[str], manifest: Manifest) -> Iterator[list[torch.Tensor]]:
    """Engine side: read-only-by-convention views of the trainer's segments, for the `with` block."""
    if len(names) != len(manifest.buckets):
        raise ValueError(f"shm.segment_names: {len(names)} segments for {len(manifest.buckets)} buckets")
    segments, views = [], []
    try:
        for name, bucket in zip(names, manifest.buckets):
            try:
                segment = shared_memory.SharedMemory(name=name)
            except FileNotFoundError as e:
                raise WeightSyncError(f"shm segment {name!r} of bucket {bucket.index} does not exist") from e
            # Python < 3.13 registers attached segments for unlinking at exit: they are the trainer's.
            resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001
            segments.append(segment)
            if segment.size < bucket.nbytes:
                raise WeightSyncError(
                    f"shm segment {name!r} holds {segment.size} bytes, bucket {bucket.index} needs {bucket.nbytes}"
                )
            views.append(torch.frombuffer(segment.buf, dtype=torch.uint8, count=bucket.nbytes) if bucket.nbytes else torch.empty(0, dtype=torch.uint8))
        yield views
    finally:
        views.clear()
        for segment in segments:
            segment.close()
