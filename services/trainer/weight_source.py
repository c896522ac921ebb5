"""Serves the trainer's weights to the host-side planes as fingerprinted buckets.

A snapshot is taken once per (weights version, source, fingerprint algorithm) and reused by every
engine that pulls that version, so all engines receive exactly the bytes the manifest describes.
When the sync reads the host store, the snapshot *is* the host actor copy's buckets (no packing,
no copy); when it reads live weights, they are packed into host buckets that are allocated once
and reused from version to version (fresh pages would cost a page fault per 4 KiB each sync). A
new snapshot, and any change of the live weights, waits until streams still reading the previous
one have finished, but not for ever: a stream whose client stopped reading is cut off after
`stalled_s` (its next chunk ends it with ABORTED), so one stalled engine never holds training or
Sleep hostage. Whatever it did receive fails verification, as bytes of a changed snapshot must.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from services.trainer.host_store import HostCopy
from services.weights.buckets import BucketSpec, Manifest, pack_bucket, plan_buckets
from services.weights.fingerprint import default_algo, fingerprint

log = logging.getLogger("rlfleet.trainer")


@dataclass(frozen=True)
class Snapshot:
    manifest: Manifest
    buffers: list[torch.Tensor]  # flat uint8 tensors, one per bucket
    plane: int = 0  # the plane it was made for, where that matters (device snapshots)
    handles: list = dataclasses.field(default_factory=list)  # CUDA IPC handles exported with it
    segment_names: list = dataclasses.field(default_factory=list)  # shared-memory names of `buffers`


def _host_buffers(sizes: list[int], cache: list[torch.Tensor]) -> list[torch.Tensor]:
    if [b.numel() for b in cache] != sizes:
        cache[:] = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return cache


STALLED_READER_S = 5.0


class StreamCutOff(RuntimeError):
    """The snapshot a stream was reading was taken from it (it had stopped reading)."""


class Reading:
    """A stream's hold on a snapshot, until the snapshot is taken from it (see `copying`)."""

    def __init__(self, source: "WeightSource", snap: Snapshot | None, generation: int):
        self.snap, self._source, self._generation = snap, source, generation

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Held while a chunk is copied out of the snapshot: the weights cannot change (nor their
        memory be freed) meanwhile, and a stream that was cut off copies nothing more."""
        with self._source._cond:  # noqa: SLF001 (held by writers for as long as they change weights)
            if self._source._generation != self._generation:  # noqa: SLF001
                raise StreamCutOff("the weights changed while this stream had stopped reading")
            yield


class WeightSource:
    def __init__(self, bucket_bytes: int, stalled_s: float = STALLED_READER_S):
        self._bucket_bytes = bucket_bytes
        self._stalled_s = stalled_s
        self._cond = threading.Condition()
        self._readers = 0
        self._generation = 0  # bumped when readers are cut off
        self._snapshot: Snapshot | None = None
        self._key: tuple | None = None
        self._packed: list[torch.Tensor] = []

    def snapshot(
        self,
        weights: HostCopy | dict[str, torch.Tensor],
        layout: list[BucketSpec] | None,
        version: int,
        source: str,
        algo: str = "",
        views: list[torch.Tensor] | None = None,
    ) -> Snapshot:
        """`weights` is a host copy laid out as `layout`, or live named tensors packed into reused
        host buffers. When the live tensors already sit in bucket layout (`views`, one flat host
        view per bucket of `layout`), the views are the buffers: nothing is packed."""
        key = (version, source, algo)
        with self._cond:
            if self._key == key:
                return self._snapshot
            self._wait_for_readers()  # the buffers are about to be rewritten
            if isinstance(weights, HostCopy):
                specs, buffers = layout, weights.buffers
            elif views is not None and all(v.device.type == "cpu" for v in views):
                specs, buffers = layout, views
            else:
                specs = plan_buckets(list(weights.items()), self._bucket_bytes)
                sizes = [s.nbytes for s in specs]
                buffers = _host_buffers(sizes, self._packed)
                with torch.no_grad():
                    for spec, out in zip(specs, buffers):
                        pack_bucket(spec, weights, out=out)
            used = algo or default_algo(buffers[0].device if buffers else "cpu")
            buckets = tuple(dataclasses.replace(s, fingerprint=fingerprint(b[: s.nbytes], used)) for s, b in zip(specs, buffers))
            manifest = Manifest(version=version, source=source, buckets=buckets, fingerprint_algo=used)
            self._snapshot, self._key = Snapshot(manifest, list(buffers)), key
            return self._snapshot

    def current(self, version: int) -> Snapshot | None:
        with self._cond:
            if self._snapshot is not None and self._snapshot.manifest.version == version:
                return self._snapshot
            return None

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held while live weights change (train, tag switch, sleep): waits for streams to finish,
        keeps new ones out, and drops the snapshot, which may alias the live weights."""
        with self._cond:
            self._wait_for_readers()
            self._snapshot = self._key = None
            yield

    def _wait_for_readers(self) -> None:
        """(Holding the condition.) Wait for the streams reading the snapshot to finish; after
        `stalled_s` cut the rest off: they end at their next chunk."""
        if self._readers and not self._cond.wait_for(lambda: not self._readers, timeout=self._stalled_s):
            log.warning("%d weight stream(s) stopped reading for %.0f s: cut off", self._readers, self._stalled_s)
            self._generation += 1

    @contextlib.contextmanager
    def reading(self, version: int) -> Iterator[Reading]:
        """Hold the snapshot of `version` (`.snap`, or None) so it is not rewritten while it is
        streamed, for as long as `.valid()` says."""
        with self._cond:
            held = Reading(self, self.current(version), self._generation)
            self._readers += 1
        try:
            yield held
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()
