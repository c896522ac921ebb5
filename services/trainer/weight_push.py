"""The trainer's side of every data plane: manifests, broadcast groups, shm segments, IPC buffers.

`manifest(plane)` lays the current weights out as fingerprinted buckets where the plane sends
from: host memory for grpc_stream, shm and gloo; the trainer's GPU for NCCL and CUDA IPC (packed
on the device from live weights, or staged host->device from the host store while asleep). The
same snapshot then serves `GetWeights`, is broadcast by `push`, or is exported for IPC, so every
engine receives exactly the bytes the manifest describes.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from services.api import weights_pb2
from services.trainer.backend import SyncWeights, TrainerStateError
from services.trainer.host_store import HostCopy
from services.trainer.weight_source import Snapshot, WeightSource
from services import rpc
from services.weights import cuda_ipc, staging
from services.weights.broadcast import WeightGroup, free_port
from services.weights.buckets import Manifest
from services.weights.errors import WeightSyncError
from services.weights.fingerprint import copy_and_fingerprint, default_algo, fingerprint, fingerprints
from services.weights.shm import ShmWriter

GRPC_STREAM, BROADCAST, CUDA_IPC, SHM = (
    weights_pb2.WEIGHT_PLANE_GRPC_STREAM,
    weights_pb2.WEIGHT_PLANE_BROADCAST,
    weights_pb2.WEIGHT_PLANE_CUDA_IPC,
    weights_pb2.WEIGHT_PLANE_SHM,
)


class WeightPusher:
    def __init__(self, trainer, store_port: int = 0):
        self.trainer = trainer
        self.store_port = store_port  # where weight-group stores listen (0: a free port each time)
        self.source = WeightSource(trainer.settings.bucket_bytes)
        self.groups: dict[str, WeightGroup] = {}
        self._shm = ShmWriter()
        self._device_snapshot: Snapshot | None = None
        self._shm_snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        self.last_manifest_seconds = 0.0  # of the last push: making the manifest (fingerprints included)

    # ---- manifests ---------------------------------------------------------------------------
    def _on_device(self, plane: int) -> bool:
        if self.trainer.device.type != "cuda":
            return False
        return plane == CUDA_IPC or (plane == BROADCAST and any(g.backend == "nccl" for g in self.groups.values()))

    def manifest(self, plane: int, algo: str = "") -> Manifest:
        trainer = self.trainer
        sync = trainer.weights_for_sync()
        if sync is None:
            raise TrainerStateError(f"rank {trainer.rank} is not the weight source of its trainer group; ask rank 0")
        if self._on_device(plane):
            return self._device_manifest(sync, algo, plane)
        if plane == SHM:
            return self._shm_manifest(sync, algo)
        return self.source.snapshot(sync.weights, sync.layout, trainer.weights_version, sync.source, algo,
                                    views=sync.views).manifest

    def _shm_manifest(self, sync: SyncWeights, algo: str) -> Manifest:
        """Copy the weights into the shm segment set written next, hashing each piece on the way."""
        trainer = self.trainer
        source, layout = sync.source, sync.layout
        snap = self._shm_snapshot
        used = algo or "xxh3"
        if snap is not None and (snap.manifest.version, snap.manifest.source, snap.manifest.fingerprint_algo) == (
            trainer.weights_version, source, used
        ):
            return snap.manifest
        buffers = sync.weights.buffers if isinstance(sync.weights, HostCopy) else sync.views
        self._shm_snapshot = None
        segments = self._shm.begin([s.nbytes for s in layout])
        try:
            prints = []
            for spec, dst, src in zip(layout, segments, buffers):
                src = src[: spec.nbytes]
                if used == "xxh3" and src.device.type == "cpu":
                    prints.append(copy_and_fingerprint(dst, src))
                else:  # exact mode, or a trainer on a GPU forced onto shm
                    dst.copy_(src)
                    prints.append(fingerprint(dst, used))
        finally:
            names = self._shm.end()
        buckets = tuple(dataclasses.replace(s, fingerprint=f) for s, f in zip(layout, prints))
        manifest = Manifest(version=trainer.weights_version, source=source, buckets=buckets, fingerprint_algo=used)
        self._shm_snapshot = Snapshot(manifest, segments, segment_names=names)
        return manifest

    def _device_manifest(self, sync: SyncWeights, algo: str, plane: int) -> Manifest:
        """Buckets the trainer's GPU sends: views of the live weights (already in bucket layout),
        or, while asleep, the host copy staged on the way out (see services/weights/staging.py)."""
        trainer = self.trainer
        source, weights = sync.source, sync.weights
        snap = self._device_snapshot
        used = algo or default_algo(trainer.device)
        if snap is not None and (snap.manifest.version, snap.manifest.source, snap.manifest.fingerprint_algo, snap.plane) == (
            trainer.weights_version, source, used, plane
        ):
            return snap.manifest
        self._device_snapshot = None
        handles: list[weights_pb2.CudaIpcHandle] = []
        names: list[str] = []
        if isinstance(weights, HostCopy):
            specs = sync.layout
            if plane == CUDA_IPC and not weights.segment_names:
                buffers, handles = staging.stage_for_ipc(weights.buffers, trainer.device)
            else:  # engines copy a shared host copy themselves; NCCL stages slot by slot while sending
                buffers = list(weights.buffers)
                names = list(weights.segment_names) if plane == CUDA_IPC else []
            # Made on the GPU when the copy was captured; otherwise (exact mode) from the host
            # bytes, which every algo reads alike ("fast" gives the same result on CPU and GPU).
            prints = weights.fingerprints.get(used) or fingerprints(weights.buffers, used)
        else:
            specs, buffers = sync.layout, sync.views
            prints = fingerprints(buffers, used)
        buckets = tuple(dataclasses.replace(s, fingerprint=f) for s, f in zip(specs, prints))
        manifest = Manifest(version=trainer.weights_version, source=source, buckets=buckets, fingerprint_algo=used)
        self._device_snapshot = Snapshot(manifest, buffers, plane=plane, handles=handles, segment_names=names)
        return manifest

    def snapshot(self, version: int, plane: int) -> Snapshot:
        if self._on_device(plane):
            snap = self._device_snapshot
            if snap is not None and snap.plane != plane:
                snap = None  # made for the other device plane: ask for a manifest of this one first
        elif plane == SHM:
            snap = self._shm_snapshot
        else:
            snap = self.source.current(version)
        if snap is None or snap.manifest.version != version:
            raise ValueError(f"version: weights version {version} has no manifest; call GetWeightManifest first")
        return snap

    # ---- groups ------------------------------------------------------------------------------
    def init_group(self, request: weights_pb2.InitWeightUpdateGroupRequest) -> int:
        """Create rank 0's store (picking a free port for master_port 0) and form the group in the background."""
        name = request.group_name or "weight_update_group"
        if request.rank_offset != 0:
            raise ValueError("rank_offset: the trainer is always rank 0 of its weight-update group")
        self.destroy_group(name)
        group = WeightGroup(
            master_address=request.master_address or "0.0.0.0",
            master_port=request.master_port or self.store_port or free_port(),
            rank=0,
            world_size=request.world_size,
            group_name=name,
            backend=request.backend or "gloo",
            timeout_s=rpc.timeout_seconds(request.timeout_s, 120.0),
            device=self.trainer.device,
        )
        group.connect_in_background()
        self.groups[name] = group
        return group.port

    def destroy_group(self, name: str) -> bool:
        group = self.groups.pop(name or "weight_update_group", None)
        if group is not None:
            group.close()
        return group is not None

    # ---- push --------------------------------------------------------------------------------
    def push(self, request) -> tuple[Manifest, list[str], list[weights_pb2.CudaIpcHandle], bool, float]:
        """Send or expose `request.version` (or the current weights): the manifest, shm segment
        names, CUDA IPC handles, whether those handles need ReleaseWeights, and the seconds taken."""
        started = time.perf_counter()
        version = request.version
        if request.current:  # the current weights, manifest and push in one call
            if request.plane == BROADCAST:
                raise ValueError("current: a broadcast needs GetWeightManifest first (engines receive it before the push)")
            version = self.manifest(request.plane, request.fingerprint_algo).version
        self.last_manifest_seconds = time.perf_counter() - started
        snap = self.snapshot(version, request.plane)
        names, handles, staged = [], [], False
        if request.plane == BROADCAST:
            group = self.groups.get(request.broadcast.group_name or "weight_update_group")
            if group is None:
                raise ValueError(f"broadcast.group_name: no group {request.broadcast.group_name!r}; call InitWeightUpdateGroup")
            try:
                if request.broadcast.packed:
                    group.broadcast_packed((_packed(spec, flat, group.device if group.backend == "nccl" else None)
                                            for spec, flat in zip(snap.manifest.buckets, snap.buffers)), src=0)
                elif group.backend == "nccl" and snap.buffers and snap.buffers[0].device.type == "cpu":  # from the host copy
                    staging.stage_and_send(snap.buffers, group.device, lambda k, slot: group.broadcast_bucket(slot, src=0))
                else:
                    group.broadcast_buckets(snap.buffers, src=0)
            except WeightSyncError:
                self.destroy_group(group.name)  # a broken collective cannot be reused
                raise
        elif request.plane == SHM:
            names = snap.segment_names
        elif request.plane == CUDA_IPC:
            if self.trainer.device.type != "cuda":
                raise ValueError("plane: cuda_ipc needs a trainer on a CUDA device")
            if snap.segment_names:  # the host copy in shared memory: engines copy it to their GPU
                names = snap.segment_names
            elif snap.handles:  # staged from the host copy: each handle carries its copy's event
                handles, staged = snap.handles, True
            else:  # live weights, re-exported each sync (the export event dates from the first one)
                torch.cuda.synchronize(self.trainer.device)
                handles = [cuda_ipc.export(i, flat) for i, flat in enumerate(snap.buffers)]
        else:
            raise ValueError(f"plane: {weights_pb2.WeightPlane.Name(request.plane)} is not pushed (engines pull grpc_stream)")
        return snap.manifest, names, handles, staged, time.perf_counter() - started

    def release(self) -> None:
        """Drop device staging (IPC buffers) once every engine has copied."""
        self._device_snapshot = None
        if self.trainer.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy_group(name)
        self._shm.close()


def _packed(spec, flat: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A bucket's tensors back to back, without the layout's alignment gaps (SGLang's
    flattened_bucket), on `device` when NCCL sends it. One bucket-sized copy at a time."""
    parts = [flat[t.offset : t.offset + t.nbytes] for t in spec.tensors]
    if device is not None:
        parts = [p.to(device, non_blocking=True) for p in parts]
    return torch.cat(parts)
