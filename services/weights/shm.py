"""The shared-memory plane: buckets in POSIX shared memory (/dev/shm), for CPU processes on one host.

The trainer writes a weights version into a set of segments (one per bucket) and hands the names
to the engines. An engine maps them, verifies them and *adopts* them: its parameters become views
of the segments, so a sync costs the trainer one copy (hashed on the way) and the engine one
hash, and every engine on the host serves the same physical copy. Only names cross the socket.

Two sets are written in turn, so the set the engines serve is never the one being written. An
engine holds a shared `flock` on every segment it serves; the trainer takes an exclusive one
before rewriting a set, and when it cannot (an engine whose last update failed still serves the
older set, say) it unlinks that set and writes a fresh one instead, so a previous version is
never changed under an engine. Locks go away with the process that held them. Linux only.

`SharedBuffers` serves the GPU case: an offloaded trainer's host copy lives in segments that are
page-locked (cudaHostRegister) in the trainer and, once mapped, in every engine on its GPU, which
then copies host->device itself (services/weights/staging.py).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import secrets
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path

import torch

from services.weights.buckets import Manifest
from services.weights.errors import WeightSyncError

SHM_DIR = Path("/dev/shm")


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _map(path: Path, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the file's first `nbytes` (MAP_SHARED; the mapping lives as long
    as the tensor or any view of it)."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def pin(t: torch.Tensor) -> None:
    """Page-lock a host mapping for the GPU (cudaHostRegister), so copies to and from the device
    run at full speed and asynchronously, in every process that maps it."""
    if not t.numel():
        return
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if error != cudart.cudaError.success:
        _clear_last_cuda_error()
        raise WeightSyncError(f"cudaHostRegister of {t.numel()} bytes failed: {cudart.cudaGetErrorString(error)}")


def _clear_last_cuda_error() -> None:
    """A failed runtime call stays CUDA's "last error", and torch would report it at its next kernel
    launch as that kernel's failure: read it off (torch binds no cudaGetLastError)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    for path in paths:
        ctypes.CDLL(path).cudaGetLastError()


def unpin(t: torch.Tensor) -> None:
    if t.numel():
        torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


@dataclass
class _SegmentSet:
    names: list[str]
    fds: list[int]
    views: list[torch.Tensor]
    sizes: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, prefix: str, sizes: list[int]) -> "_SegmentSet":
        if not available():
            raise WeightSyncError(f"shm: {SHM_DIR} is missing or not writable; use another weight_sync.plane")
        made = cls([], [], [], list(sizes))
        try:
            for size in sizes:
                name = f"{prefix}-{secrets.token_hex(8)}"
                fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                made.names.append(name)
                made.fds.append(fd)
                # The resource tracker unlinks the segment should this process die without close().
                resource_tracker.register(f"/{name}", "shared_memory")
                # Reserve the pages now: a /dev/shm too small for the set fails here with ENOSPC,
                # where a merely truncated file would kill the process with SIGBUS on first write.
                os.posix_fallocate(fd, 0, max(size, 1))
                made.views.append(_map(SHM_DIR / name, size))
        except OSError as e:
            made.close()
            raise WeightSyncError(f"shm: cannot create a {sum(sizes)}-byte segment set in {SHM_DIR}: {e}") from e
        return made

    def lock_for_writing(self) -> bool:
        """Exclusive locks on every segment, or none (False: some engine still serves this set)."""
        for k, fd in enumerate(self.fds):
            if not _try_lock(fd, fcntl.LOCK_EX):
                for held in self.fds[:k]:
                    fcntl.flock(held, fcntl.LOCK_UN)
                return False
        return True

    def unlock(self) -> None:
        for fd in self.fds:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """Unlink and close; engines that mapped the segments keep them until they let go."""
        for name in self.names:
            try:
                os.unlink(SHM_DIR / name)
            except FileNotFoundError:
                pass
            resource_tracker.unregister(f"/{name}", "shared_memory")
        for fd in self.fds:
            os.close(fd)
        self.names, self.fds, self.views = [], [], []


class SharedBuffers:
    """Host buffers other processes can map by name (the trainer's host copy of the weights),
    page-locked for the GPU when `pinned`. Unlinked on close."""

    def __init__(self, sizes: list[int], *, pinned: bool, prefix: str = "rlfleet-host"):
        self._set = _SegmentSet.create(prefix, sizes)
        self.pinned = False
        if pinned:
            try:
                for view in self._set.views:
                    pin(view)
            except BaseException:
                self.close()
                raise
            self.pinned = True

    @property
    def names(self) -> list[str]:
        return list(self._set.names)

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._set.views)

    def close(self) -> None:
        if self.pinned:
            for view in self._set.views:
                unpin(view)
            self.pinned = False
        self._set.close()

    def __del__(self) -> None:
        # Unregister before the mappings go: CUDA would keep the range registered, and a later
        # mapping at the same address could not be registered again.
        try:
            self.close()
        except Exception:  # noqa: BLE001 (interpreter shutdown: CUDA may be gone)
            pass


class ShmWriter:
    """Trainer side: two segment sets used in turn (and unlinked on close)."""

    def __init__(self, prefix: str = "rlfleet"):
        self._prefix = prefix
        self._sets: list[_SegmentSet | None] = [None, None]
        self._last = 1  # the set written last; the next write goes to the other one
        self._writing: _SegmentSet | None = None
        self.fresh_sets = 0  # sets created because the old one was held or resized (for tests, logs)

    def begin(self, sizes: list[int]) -> list[torch.Tensor]:
        """Exclusively locked, writable flat uint8 views of the set to write next; call `end()`."""
        k = 1 - self._last
        current = self._sets[k]
        if current is None or current.sizes != sizes or not current.lock_for_writing():
            if current is not None:
                current.close()
            current = self._sets[k] = _SegmentSet.create(self._prefix, sizes)
            self.fresh_sets += 1
            if not current.lock_for_writing():
                raise WeightSyncError("shm: a segment set that was just created is locked")
        self._writing, self._last = current, k
        return current.views

    def end(self) -> list[str]:
        """Release the write locks; returns the names of the set just written."""
        written, self._writing = self._writing, None
        written.unlock()
        return list(written.names)

    def close(self) -> None:
        for k, s in enumerate(self._sets):
            if s is not None:
                s.close()
            self._sets[k] = None


class ShmReader:
    """Engine side: maps the trainer's segments (kept mapped while the trainer reuses them, so a
    steady-state sync neither maps nor faults in pages again) and holds shared locks on the set
    the engine serves."""

    def __init__(self):
        self._maps: dict[str, torch.Tensor] = {}
        self._held: dict[str, int] = {}  # name -> fd with a shared lock: the set being served
        self._pending: dict[str, int] = {}  # locked for an update not yet adopted
        self._opened: list[str] = []
        self._previous: set[str] = set()
        self._pinned: set[str] = set()  # mappings page-locked for the GPU

    def open(self, names: list[str], manifest: Manifest, *, pinned: bool = False) -> list[torch.Tensor]:
        """Lock and map one segment per bucket; `adopted()` or `abandon()` must follow. With
        `pinned` the mappings are page-locked for the GPU (once; they stay so while mapped)."""
        if len(names) != len(manifest.buckets):
            raise ValueError(f"shm.segment_names: {len(names)} segments for {len(manifest.buckets)} buckets")
        self.abandon()
        try:
            views = [self._open_one(name, bucket.index, bucket.nbytes) for name, bucket in zip(names, manifest.buckets)]
            if pinned:
                for name in names:
                    if name not in self._pinned:
                        pin(self._maps[name])
                        self._pinned.add(name)
        except BaseException:
            self.abandon()
            raise
        self._opened = list(names)
        return views

    def _open_one(self, name: str, index: int, nbytes: int) -> torch.Tensor:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"shm.segment_names: {name!r} is not a segment name")
        fd = self._held.get(name)
        if fd is None:
            try:
                fd = os.open(SHM_DIR / name, os.O_RDWR)
            except FileNotFoundError as e:
                raise WeightSyncError(f"shm segment {name!r} of bucket {index} does not exist") from e
            if not _try_lock(fd, fcntl.LOCK_SH):
                os.close(fd)
                raise WeightSyncError(f"shm segment {name!r} is being rewritten by the trainer (a newer version)")
            self._pending[name] = fd
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise WeightSyncError(f"shm segment {name!r} holds {size} bytes, bucket {index} needs {nbytes}")
        mapped = self._maps.get(name)
        if mapped is None or mapped.numel() != size:
            self._forget(name)
            mapped = self._maps[name] = _map(SHM_DIR / name, size)
        return mapped[:nbytes]

    def _forget(self, name: str) -> None:
        mapped = self._maps.pop(name, None)
        if name in self._pinned:
            self._pinned.discard(name)
            unpin(mapped)

    def adopted(self) -> None:
        """The engine now serves the set opened last: keep its locks, release the previous set's."""
        current = set(self._opened)
        for name in [n for n in self._held if n not in current]:
            os.close(self._held.pop(name))
        self._held.update(self._pending)
        self._pending = {}
        for name in [n for n in self._maps if n not in current and n not in self._previous]:
            self._forget(name)  # neither of the two sets the trainer writes in turn
        self._previous = current

    def copied(self) -> None:
        """The update copied out of the set opened last instead of adopting it (an engine on a
        GPU reading the trainer's host copy): release its locks, keep its mappings for next time."""
        self.abandon()
        keep = set(self._opened) | set(self._held)
        for name in [n for n in self._maps if n not in keep]:
            self._forget(name)

    def abandon(self) -> None:
        """The update failed: release its locks; the set being served keeps its own."""
        for fd in self._pending.values():
            os.close(fd)
        self._pending = {}

    def release(self) -> None:
        """The engine serves no segment any more (its weights were released or replaced)."""
        self.abandon()
        for fd in self._held.values():
            os.close(fd)
        self._held = {}

    def close(self) -> None:
        self.release()
        for name in list(self._maps):
            self._forget(name)

    def __del__(self) -> None:
        try:
            self.close()  # unregister pinned mappings before they go (see SharedBuffers)
        except Exception:  # noqa: BLE001
            pass
