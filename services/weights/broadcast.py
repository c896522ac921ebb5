"""The broadcast plane: weight buckets sent by one trainer rank to every engine rank at once.

A group is a standalone torch.distributed process group (gloo on CPU, NCCL on GPUs) built on its
own TCP store, so it never touches a process's default group and several can coexist. Rank 0 is
the trainer; engine ranks follow from `rank_offset`, as in SGLang's init_weights_update_group.
The trainer creates the store first (it may pick a free port), and the group forms when every
rank has joined; joining blocks until then, so callers join concurrently.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import socket
import threading
import time
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from services.weights.errors import WeightSyncError

log = logging.getLogger("rlfleet.weights")
BACKENDS = ("gloo", "nccl")
MAX_WORLD_SIZE = 4096
# Buckets travel in parts this size, so the receiver verifies part k while part k+1 arrives.
PART_BYTES = 64 << 20


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class WeightGroup:
    """One rank's membership of a weight-update group."""

    def __init__(self, *, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float, device: torch.device):
        if backend not in BACKENDS:
            raise ValueError(f"backend: unknown backend {backend!r} (expected gloo or nccl)")
        if backend == "nccl" and device.type != "cuda":
            raise ValueError("backend: nccl needs a CUDA device; use gloo on CPU")
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size: must be in [1, {MAX_WORLD_SIZE}], got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank_offset: rank {rank} is outside the group of {world_size}")
        if not 0 <= master_port <= 65535:
            raise ValueError(f"master_port: {master_port} is not a TCP port")
        if rank != 0 and (not master_address or master_port == 0):
            raise ValueError("master_address, master_port: a joining rank needs rank 0's address and port")
        if not (math.isfinite(timeout_s) and 0 < timeout_s <= 86400):
            raise ValueError(f"timeout_s: must be seconds in (0, 86400], got {timeout_s}")
        self.name, self.rank, self.world_size, self.backend = group_name, rank, world_size, backend
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self._store = dist.TCPStore(
                master_address, master_port, world_size, is_master=rank == 0, timeout=self.timeout,
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as e:  # torch's DistError types are RuntimeErrors
            where = "listen on" if rank == 0 else "reach rank 0 at"
            raise WeightSyncError(f"group {group_name!r}: rank {rank} could not {where} {master_address}:{master_port} "
                                  f"within {timeout_s:g} s: {' '.join(str(e).split())[:300]}") from e
        self.port = self._store.port
        self._pg = None
        self._lock = threading.Lock()
        self._in_flight = 0  # calls with collectives under way
        self._abort_when_idle = None  # a closed gloo communicator, aborted when its last call ends
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def connect(self) -> "WeightGroup":
        """Form the group (blocks until every rank has joined or the timeout passes).

        The group is built the way SGLang builds its end of `/init_weights_update_group` (and
        slime and miles their trainer's): torch's process-group helper over the TCP store with
        the group name as key prefix. Any other construction names its keys differently, and an
        SGLang engine would wait for a rendezvous that never comes."""
        try:
            options = None
            if self.backend == "nccl":
                # By default NCCL's watchdog takes the whole process down when a collective times
                # out. A stalled engine must fail the sync, not kill the trainer: our own wait
                # times out instead, and close() aborts the communicator.
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
                # A trainer that sends from its host copy uploads bucket k+1 with a kernel on every
                # SM while bucket k is broadcast; at normal priority the broadcast's blocks would
                # queue behind the upload's, and the two would take turns instead of overlapping.
                options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
                options._timeout = self.timeout
            self._pg = sglang_compatible_group(self._store, self.name, self.rank, self.world_size, self.backend,
                                               self.timeout, options)
        except BaseException as e:
            self._error = e
            raise WeightSyncError(f"group {self.name!r}: rank {self.rank} could not join: {e}") from e
        finally:
            self._ready.set()
        return self

    def connect_in_background(self) -> None:
        threading.Thread(target=self._connect_quietly, name=f"group-{self.name}", daemon=True).start()

    def _connect_quietly(self) -> None:
        try:
            self.connect()
        except WeightSyncError:
            pass  # reported by wait_ready

    def wait_ready(self) -> None:
        if not self._ready.wait(self.timeout.total_seconds()):
            raise WeightSyncError(f"group {self.name!r}: engines did not join within {self.timeout.total_seconds():.0f}s")
        if self._error is not None:
            raise WeightSyncError(f"group {self.name!r}: could not form: {self._error}") from self._error

    def broadcast_bucket(self, flat: torch.Tensor, src: int = 0, on_part: Callable[[int], None] | None = None) -> None:
        """Broadcast one flat uint8 bucket (see `broadcast_buckets`)."""
        self.broadcast_buckets([flat], src, None if on_part is None else lambda _, n: on_part(n))

    def broadcast_buckets(self, flats: Sequence[torch.Tensor], src: int = 0,
                          on_part: Callable[[int, int], None] | None = None) -> None:
        """Send (rank src) or receive (others) flat uint8 buckets, every piece queued at once, so
        nothing waits between buckets. `on_part(k, n)` runs as soon as the first n bytes of
        bucket k have arrived (for NCCL: are ordered before the current stream's next work), so a
        receiver verifies them while the rest is in flight. Gloo cuts buckets into parts of
        `PART_BYTES`; NCCL sends each whole and pipelines it itself. Every rank must pass buckets
        of the same sizes."""
        self.wait_ready()
        step = None if self.backend == "nccl" else PART_BYTES
        pieces = [(k, start, stop) for k, flat in enumerate(flats) for start, stop in _cut(flat.numel(), step)]
        with self._collectives() as pg:
            works = [pg.broadcast([flats[k][start:stop]], _options(src)) for k, start, stop in pieces]
            for work, (k, _, stop) in zip(works, pieces):
                self._wait(work)
                if on_part is not None:
                    on_part(k, stop)

    def broadcast_packed(self, flats: Iterable[torch.Tensor], src: int = 0) -> None:
        """Each flat buffer as ONE broadcast, whole: the collectives a receiver that sizes its
        buffer from the tensors it expects (SGLang's flattened_bucket) posts, one per bucket.
        `flats` may be a generator: a buffer is made only when the one before it has gone."""
        self.wait_ready()
        with self._collectives() as pg:
            for flat in flats:
                self._wait(pg.broadcast([flat], _options(src)))

    @contextlib.contextmanager
    def _collectives(self):
        """The communicator, for one call's collectives; their failures as WeightSyncError."""
        with self._lock:
            pg = self._pg
            if pg is None:
                raise WeightSyncError(f"group {self.name!r} is closed")
            self._in_flight += 1
        try:
            yield pg
        except RuntimeError as e:
            if isinstance(e, WeightSyncError):
                raise
            raise WeightSyncError(f"group {self.name!r}: broadcast failed on rank {self.rank}: {e}") from e
        finally:
            with self._lock:
                self._in_flight -= 1
                leftover = self._abort_when_idle if self._in_flight == 0 else None
                if leftover is not None:
                    self._abort_when_idle = None
            if leftover is not None:
                _abort(leftover)

    def _wait(self, work) -> None:
        """Until `work` is done, or WeightSyncError after the group's timeout. NCCL's own timed
        wait polls every millisecond, a real cost when a whole sync takes tens of them; here the
        host polls finer, then orders the current stream after the broadcast."""
        if self.backend != "nccl":
            work.wait(self.timeout)
            return
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise WeightSyncError(f"group {self.name!r}: broadcast timed out after "
                                      f"{self.timeout.total_seconds():.0f}s on rank {self.rank}")
            time.sleep(20e-6)
        work.wait()  # raises the collective's error, if it had one

    def close(self, wait_s: float = 10.0) -> None:
        """Abort the communicator, waiting at most `wait_s`: callers hold their service's lock,
        and an abort stuck on a collective that will never finish must not hold it forever.

        Gloo's abort waits, holding the GIL, for the collectives in flight, which end only at
        the group's timeout; so a gloo group closed while a call still waits on it is aborted by
        that call when it ends, and close returns at once."""
        with self._lock:
            pg, self._pg = self._pg, None
            deferred = pg is not None and self.backend == "gloo" and self._in_flight > 0
            if deferred:
                self._abort_when_idle = pg
        if pg is not None:
            _forget(pg)  # first: an abort that hangs must not keep the name from the next group
        if pg is not None and not deferred:
            aborting = threading.Thread(target=_abort, args=(pg,), name=f"abort-{self.name}", daemon=True)
            aborting.start()
            aborting.join(wait_s)
            if aborting.is_alive():
                log.warning("group %r: aborting its communicator did not finish within %.0fs; left to finish "
                            "in the background", self.name, wait_s)
        self._store = None


def sglang_compatible_group(store: dist.Store, name: str, rank: int, world_size: int, backend: str,
                            timeout: datetime.timedelta, options=None):
    """A process group keyed in `store` as SGLang's `init_custom_process_group` keys it: the
    group name as prefix, then torch's own per-group and per-device prefixes (for gloo one
    backend per device type, cpu and cuda, each with its own rendezvous)."""
    from torch.distributed import distributed_c10d as c10d

    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), dist.PrefixStore(name, store), group_name=name,
        backend_options=options, timeout=timeout,
    )
    return pg


def _abort(pg) -> None:
    try:
        if hasattr(pg, "abort"):
            pg.abort()
        else:
            pg.shutdown()
    except RuntimeError:
        pass


def _forget(pg) -> None:
    """Take `pg` out of torch's registry of named groups (what destroy_process_group does after
    its shutdown, which can hang or fail on a broken group), so its name can be used again: a
    trainer outlives coordinators, and each new one numbers its groups from 1 again."""
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    name = world.pg_names.get(pg)
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                  world.pg_coalesce_state):
        table.pop(pg, None)
    tag = world.pg_to_tag.pop(pg, None)
    for key in (tag, ""):
        if key is not None and pg in world.tags_to_pg.get(key, []):
            world.tags_to_pg[key].remove(pg)
    if name is not None:
        try:
            c10d._unregister_process_group(name)
        except (RuntimeError, KeyError, ValueError):
            pass


def _cut(nbytes: int, step: int | None) -> list[tuple[int, int]]:
    if step is None or nbytes <= step:
        return [(0, nbytes)]
    return [(start, min(start + step, nbytes)) for start in range(0, nbytes, step)]


def _options(src: int) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    return options
