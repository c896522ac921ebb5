"""The shared-memory plane: buckets in POSIX shared memory, for CPU processes on one host.

The trainer keeps one segment per bucket and reuses them from sync to sync (new segments only
when a bucket's size changes), writes the buckets there and hands the segment names to the
engines, which verify and copy straight from the mapped segments. Only names cross the socket.
"""

from __future__ import annotations

import secrets
from multiprocessing import resource_tracker, shared_memory
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
                self._views.append(_view(segment, size))
        return self._views

    def owns(self, buffers: list[torch.Tensor]) -> bool:
        return len(buffers) == len(self._views) and all(a is b for a, b in zip(buffers, self._views))

    @property
    def names(self) -> list[str]:
        return [s.name for s in self._segments]

    def close(self) -> None:
        self._views = []
        for segment in self._segments:
            segment.close()
            segment.unlink()
        self._segments = []


class ShmReader:
    """Engine side: maps the trainer's segments and keeps them mapped while their names stay the
    same, so a steady-state sync neither maps nor faults in pages again."""

    def __init__(self):
        self._segments: dict[str, shared_memory.SharedMemory] = {}

    def views(self, names: list[str], manifest: Manifest) -> list[torch.Tensor]:
        if len(names) != len(manifest.buckets):
            raise ValueError(f"shm.segment_names: {len(names)} segments for {len(manifest.buckets)} buckets")
        for stale in set(self._segments) - set(names):
            self._segments.pop(stale).close()
        views = []
        for name, bucket in zip(names, manifest.buckets):
            segment = self._segments.get(name)
            if segment is None:
                try:
                    segment = shared_memory.SharedMemory(name=name)
                except FileNotFoundError as e:
                    raise WeightSyncError(f"shm segment {name!r} of bucket {bucket.index} does not exist") from e
                # Python < 3.13 registers attached segments for unlinking at exit: they are the trainer's.
                resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001
                self._segments[name] = segment
            if segment.size < bucket.nbytes:
                raise WeightSyncError(
                    f"shm segment {name!r} holds {segment.size} bytes, bucket {bucket.index} needs {bucket.nbytes}"
                )
            views.append(_view(segment, bucket.nbytes))
        return views

    def close(self) -> None:
        for segment in self._segments.values():
            try:
                segment.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with the process
        self._segments.clear()


def _view(segment: shared_memory.SharedMemory, nbytes: int) -> torch.Tensor:
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
