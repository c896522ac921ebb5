"""The host store: one host copy of the weights per tag, laid out as the weight-sync buckets.

Each tag (`actor`, `ref`, `old_actor`, `teacher`) gets flat uint8 host buffers allocated once and
reused for every capture, pinned when CUDA is present so device<->host copies run at full speed
and asynchronously. Because the layout is the sync bucket layout, a weight sync that reads the
host copy serves these buffers as they are: no packing, no extra copy.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from services.weights import shm
from services.weights.apply import copy_bytes_
from services.weights.buckets import BucketSpec, plan_buckets, unpack_bucket
from services.weights.errors import WeightSyncError

log = logging.getLogger("rlfleet.trainer")

ACTOR = "actor"


@dataclass
class HostCopy:
    buffers: list[torch.Tensor]           # flat uint8 per bucket
    views: dict[str, torch.Tensor]        # name -> typed view into its bucket
    version: int = -1                     # weights version captured; -1 = never
    # Bucket fingerprints of these bytes by algo, made where they were captured from (on the
    # GPU, beside the copy), so a sync from the host copy does not have to read it again.
    fingerprints: dict[str, list[str]] = field(default_factory=dict)
    # Shared-memory names of `buffers` when other processes on the host can map them (engines on
    # the trainer's GPU then copy host->device themselves); empty for private buffers.
    segment_names: list[str] = field(default_factory=list)


@dataclass
class CopyStats:
    """Bytes moved by the store, so tests and benchmarks can see what a switch really cost."""

    bytes_captured: int = 0
    bytes_restored: int = 0
    restores: dict[str, int] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HostStore:
    def __init__(self, named: list[tuple[str, torch.Tensor]], bucket_bytes: int, *, share: tuple[str, ...] = ()):
        """Tags in `share` get buffers in shared memory (when /dev/shm can hold them)."""
        self.layout: list[BucketSpec] = plan_buckets(named, bucket_bytes)
        self.pinned = torch.cuda.is_available()
        self.stats = CopyStats()
        self._copies: dict[str, HostCopy] = {}
        self._share = set(share)
        self._shared: dict[str, shm.SharedBuffers] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Unlink shared buffers (engines that mapped them keep their mappings)."""
        with self._lock:
            for shared in self._shared.values():
                shared.close()
            self._shared.clear()
            for tag in [t for t, c in self._copies.items() if c.segment_names]:
                del self._copies[tag]

    @property
    def tags(self) -> list[str]:
        return list(self._copies)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for c in self._copies.values() for b in c.buffers)

    def version(self, tag: str) -> int:
        copy = self._copies.get(tag)
        return -1 if copy is None else copy.version

    def invalidate(self, tag: str) -> None:
        """Forget what the tag's copy holds (its buffers stay allocated for the next capture)."""
        if tag in self._copies:
            self._copies[tag].version = -1

    def get(self, tag: str) -> HostCopy:
        if tag not in self._copies:
            raise KeyError(f"tag {tag!r} has no host copy (have: {', '.join(self._copies) or 'none'})")
        return self._copies[tag]

    def _ensure(self, tag: str) -> HostCopy:
        copy = self._copies.get(tag)
        if copy is None:
            buffers, names = self._allocate(tag)
            views = {}
            for spec, flat in zip(self.layout, buffers):
                views.update(unpack_bucket(spec, flat))
            copy = self._copies[tag] = HostCopy(buffers, views, segment_names=names)
        return copy

    def _allocate(self, tag: str) -> tuple[list[torch.Tensor], list[str]]:
        """Zeroed buffers (alignment gaps must read as zeros, as pack_bucket lays them out)."""
        sizes = [b.nbytes for b in self.layout]
        if tag in self._share and shm.available():
            try:
                shared = self._shared[tag] = shm.SharedBuffers(sizes, pinned=self.pinned)  # new pages are zero
                return shared.buffers, shared.names
            except (WeightSyncError, RuntimeError) as e:
                log.warning("host copy %r stays private (engines cannot map it): %s", tag, e)
        return [torch.zeros(n, dtype=torch.uint8, pin_memory=self.pinned) for n in sizes], []

    def capture(self, tag: str, tensors: dict[str, torch.Tensor], version: int, *, wait: bool = True) -> int:
        """Copy device tensors into the tag's host copy (allocating it the first time).

        With `wait=False` the copies may still be in flight on return: the caller synchronises
        (Sleep queues the optimizer-state copies behind these and waits once)."""
        with self._lock:
            copy = self._ensure(tag)
            moved = self._copy(copy, tensors, to_host=True, wait=wait)
            copy.version, copy.fingerprints = version, {}
            self.stats.bytes_captured += moved
            return moved

    def restore(self, tag: str, tensors: dict[str, torch.Tensor]) -> int:
        """Copy the tag's host values into device tensors of the same names and shapes."""
        with self._lock:
            moved = self._copy(self.get(tag), tensors, to_host=False, wait=True)
            self.stats.bytes_restored += moved
            self.stats.restores[tag] = self.stats.restores.get(tag, 0) + 1
            return moved

    def _copy(self, copy: HostCopy, tensors: dict[str, torch.Tensor], *, to_host: bool, wait: bool) -> int:
        moved, device = 0, torch.device("cpu")
        with torch.no_grad():
            for name, view in copy.views.items():
                live = tensors[name]
                device = live.device
                if to_host:
                    copy_bytes_(view, live.detach(), non_blocking=self.pinned)
                else:
                    copy_bytes_(live, view, non_blocking=self.pinned)
                moved += view.numel() * view.element_size()
        if wait:
            _sync(device)
        return moved

    def load_bytes_into(self, tag: str, other: "HostCopy") -> None:
        """Make `tag` a host-side copy of another host copy (old_actor <- actor)."""
        with self._lock:
            copy = self._ensure(tag)
            for dst, src in zip(copy.buffers, other.buffers):
                dst.copy_(src)
            copy.version, copy.fingerprints = other.version, dict(other.fingerprints)
