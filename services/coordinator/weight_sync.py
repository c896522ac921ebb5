"""Weight-sync orchestration: choose a data plane per engine, run the sync, keep groups cached.

Planes come from what each side reported at Configure (`Capabilities`): `cuda_ipc` when an engine
shares the trainer's GPU, `broadcast` (NCCL between GPUs, gloo between CPU processes on different
hosts), `shm` between CPU processes on one host, `grpc_stream` otherwise. A forced plane that
cannot work for some engine is a ValueError naming the engine and the reason. Broadcast groups
are cached across syncs and rebuilt when the set of engines changes or a sync broke one.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from services.api import weights_pb2
from services.coordinator.clients import PeerError, RolloutClient, TrainerClient, wait_all
from services.rpc import FanOut

PLANES = {
    "grpc_stream": weights_pb2.WEIGHT_PLANE_GRPC_STREAM,
    "broadcast": weights_pb2.WEIGHT_PLANE_BROADCAST,
    "shm": weights_pb2.WEIGHT_PLANE_SHM,
    "cuda_ipc": weights_pb2.WEIGHT_PLANE_CUDA_IPC,
}
_group_ids = itertools.count(1)


def choose_plane(trainer: weights_pb2.Capabilities, engine: weights_pb2.Capabilities, forced: str, who: str) -> str:
    """The plane for one engine: what its placement allows, among the planes it offers (an
    SGLang engine takes weights only by broadcast, and on its own GPU by CUDA IPC)."""
    offered = {name for name, number in PLANES.items() if number in engine.planes} or set(PLANES)
    plane = _placement_plane(trainer, engine, forced, who)
    if plane in offered:
        return plane
    if forced == "auto" and "broadcast" in offered and plane != "cuda_ipc":
        return "broadcast"
    raise ValueError(f"weight_sync.plane: engine {who} takes weights over {', '.join(sorted(offered))}, "
                     f"not {plane}")


def _placement_plane(trainer, engine, forced: str, who: str) -> str:
    shared_gpu = bool(set(trainer.gpu_uuids) & set(engine.gpu_uuids))
    same_host = trainer.host_id == engine.host_id and bool(trainer.host_id)
    both_gpu = bool(trainer.gpu_uuids) and bool(engine.gpu_uuids)
    if forced == "auto":
        if shared_gpu:
            return "cuda_ipc"
        if both_gpu or not same_host:
            return "broadcast"
        if not trainer.gpu_uuids and not engine.gpu_uuids:
            return "shm"
        return "grpc_stream"
    reasons = {
        "cuda_ipc": None if shared_gpu else "it shares no GPU with the trainer",
        "shm": None if same_host else "it runs on another host than the trainer",
        "broadcast": "it shares the trainer's GPU and NCCL refuses two ranks on one GPU" if shared_gpu else None,
    }
    if reasons.get(forced):
        raise ValueError(f"weight_sync.plane: {forced} is impossible for engine {who}: {reasons[forced]}")
    return forced


def broadcast_backend(trainer: weights_pb2.Capabilities, engines: list[weights_pb2.Capabilities]) -> str:
    return "nccl" if trainer.gpu_uuids and all(e.gpu_uuids for e in engines) else "gloo"


def _check_nccl_ranks(trainer: weights_pb2.Capabilities, engines: list[tuple[str, weights_pb2.Capabilities]]) -> None:
    """NCCL refuses two ranks on one GPU, and would say so only when the group forms, in a log."""
    if not engines or broadcast_backend(trainer, [caps for _, caps in engines]) != "nccl":
        return
    owner: dict[str, str] = {}
    for address, caps in engines:
        for uuid in caps.gpu_uuids:
            if uuid in owner:
                raise ValueError(
                    f"weight_sync.plane: engines {owner[uuid]} and {address} share GPU {uuid}, and NCCL refuses "
                    "two ranks on one GPU: give each engine its own GPU (rollout.devices)")
            owner[uuid] = address


@dataclass
class _Group:
    name: str
    members: tuple[int, ...]


@dataclass
class SyncResult:
    version: int
    source: str
    total_bytes: int
    planes: dict[str, str] = field(default_factory=dict)   # engine address -> plane
    failures: dict[str, str] = field(default_factory=dict)  # engine address -> error
    ok: set[int] = field(default_factory=set)


class WeightSyncer:
    def __init__(self, *, trainer: TrainerClient, engines: list[RolloutClient], trainer_caps, engine_caps,
                 forced: str, exact: bool, timeout_s: float, token: str, pool: ThreadPoolExecutor,
                 policy: str = "drain", fanout: FanOut | None = None):
        self.trainer, self.engines = trainer, engines
        self._fanout = fanout  # carries every engine's UpdateWeights at once (else each is its channel's future)
        self.policy = policy  # what the engines do with rows generating when the weights change
        self.trainer_caps, self.engine_caps = trainer_caps, engine_caps
        self.exact, self.timeout_s, self.token, self._pool = exact, timeout_s, token, pool
        self._forced = forced
        self.planes = [choose_plane(trainer_caps, caps, forced, e.address) for e, caps in zip(engines, engine_caps)]
        _check_nccl_ranks(trainer_caps, [(e.address, caps) for e, caps, plane in zip(engines, engine_caps, self.planes)
                                         if plane == "broadcast"])
        self._group: _Group | None = None

    def replace_engine(self, index: int, client: RolloutClient) -> None:
        """Engine `index` is now `client` (its worker moved): new capabilities, plane and group."""
        self.engines[index] = client
        self.engine_caps[index] = client.capabilities
        self.planes[index] = choose_plane(self.trainer_caps, client.capabilities, self._forced, client.address)
        self._drop_group()  # the member at this rank is another process now

    def add_engine(self, client: RolloutClient) -> int:
        """A new engine (an elastic job's fleet grew): its index; it gets weights at the next sync."""
        plane = choose_plane(self.trainer_caps, client.capabilities, self._forced, client.address)
        if plane == "broadcast":
            _check_nccl_ranks(self.trainer_caps, [(e.address, caps) for e, caps, p in
                                                  zip([*self.engines, client], [*self.engine_caps, client.capabilities],
                                                      [*self.planes, plane]) if p == "broadcast"])
        self.engines.append(client)
        self.engine_caps.append(client.capabilities)
        self.planes.append(plane)
        return len(self.engines) - 1

    def sync(self, alive: set[int], only: set[int] | None = None) -> SyncResult:
        """Sync every engine in `alive` (plus any that answers again), of those in `only` when
        given; returns who got the weights."""
        by_plane: dict[str, list[int]] = {}
        for index, plane in enumerate(self.planes):
            if only is None or index in only:
                by_plane.setdefault(plane, []).append(index)
        result = None
        for plane, members in by_plane.items():
            part = getattr(self, f"_sync_{plane}")(members)
            if result is None:
                result = part
            else:
                result.failures.update(part.failures)
                result.ok |= part.ok
            result.planes.update({self.engines[i].address: plane for i in members})
        return result

    def _algo(self) -> str:
        return "sha256" if self.exact else ""

    def _update_all(self, members, manifest, **source) -> SyncResult:
        return self._collect(self._submit_updates(members, manifest, **source), manifest)

    def _submit_updates(self, members, manifest, **source) -> dict:
        return {
            i: self.engines[i].update_weights_async(manifest, self.timeout_s, self.exact, policy=self.policy,
                                                    fanout=self._fanout, **source)
            for i in members
        }

    def _collect(self, futures: dict, manifest) -> SyncResult:
        result = SyncResult(manifest.version, manifest.source, manifest.total_bytes)
        wait_all(list(futures.values()))
        for i, fut in futures.items():
            try:
                fut.result()
                result.ok.add(i)
            except PeerError as e:
                result.failures[self.engines[i].address] = str(e)
        return result

    def _sync_grpc_stream(self, members) -> SyncResult:
        manifest = self.trainer.weight_manifest(self._algo(), PLANES["grpc_stream"], self.timeout_s)
        endpoint = weights_pb2.TrainerEndpoint(address=self.trainer.address, token=self.token)
        return self._update_all(members, manifest, trainer=endpoint)

    def _sync_shm(self, members) -> SyncResult:
        # the manifest and the push in one call
        reply = self.trainer.push_weights(PLANES["shm"], None, fingerprint_algo=self._algo(), timeout_s=self.timeout_s)
        return self._update_all(members, reply.manifest, shm=weights_pb2.ShmSource(segment_names=reply.shm_segments))

    def _sync_cuda_ipc(self, members) -> SyncResult:
        reply = self.trainer.push_weights(PLANES["cuda_ipc"], None, fingerprint_algo=self._algo(),
                                         timeout_s=self.timeout_s)
        if reply.shm_segments:  # an offloaded trainer's host copy: each engine uploads it; nothing to release
            return self._update_all(members, reply.manifest, shm=weights_pb2.ShmSource(segment_names=reply.shm_segments))
        try:
            return self._update_all(members, reply.manifest, cuda_ipc=weights_pb2.CudaIpcSource(handles=reply.cuda_ipc_handles))
        finally:
            if reply.release_required:  # staged copies, not the live weights: free them now
                self.trainer.release_weights(reply.manifest.version, self.timeout_s)

    def _sync_broadcast(self, members) -> SyncResult:
        # A cached group is used as it is: a member that died or stalls since fails the collective
        # within the timeout. Only a group about to be (re)built is probed first, because a rank
        # that never joins would hold every other rank until the timeout.
        cached = self._group is not None and self._group.members == tuple(members)
        reachable = list(members) if cached else [i for i in members if self._answers(i)]
        failures = {self.engines[i].address: "engine does not answer; left out of the group" for i in members if i not in reachable}
        if not reachable:
            return SyncResult(-1, "", 0, failures=failures)
        try:
            group = self._ensure_group(tuple(reachable))
        except PeerError as e:
            self._drop_group()
            failures.update({self.engines[i].address: f"could not form the broadcast group: {e}" for i in reachable})
            return SyncResult(-1, "", 0, failures=failures)
        manifest = self.trainer.weight_manifest(self._algo(), PLANES["broadcast"], self.timeout_s)
        packed = {bool(self.engine_caps[i].packed_broadcast) for i in reachable}
        if len(packed) > 1:
            raise ValueError("rollout.engine: one broadcast group cannot serve engines that take packed buckets "
                             "(sglang) and engines that take laid-out ones (torch) at once")
        source = weights_pb2.BroadcastSource(group_name=group.name, src_rank=0, packed=packed.pop())
        push = self._pool.submit(self.trainer.push_weights, PLANES["broadcast"], manifest.version, source,
                                 timeout_s=self.timeout_s)
        updates = self._submit_updates(reachable, manifest, broadcast=source)
        push_error = None
        try:
            push.result()
        except PeerError as e:
            push_error = str(e)
            self._drop_group()  # engines already waiting on the collective are let go now, not at their timeout
        result = self._collect(updates, manifest)
        if push_error is not None:
            result.failures.setdefault(self.trainer.address, push_error)
        if result.failures:
            self._drop_group()  # a collective that failed on any rank cannot be reused
        result.failures.update(failures)
        return result

    def _answers(self, index: int) -> bool:
        try:
            self.engines[index].status(timeout_s=5.0)
            return True
        except PeerError:
            return False

    def _ensure_group(self, members: tuple[int, ...]) -> _Group:
        if self._group is not None and self._group.members == members:
            return self._group
        self._drop_group()
        name = f"rlfleet-weights-{next(_group_ids)}"
        backend = broadcast_backend(self.trainer_caps, [self.engine_caps[i] for i in members])
        # An engine joins with as many ranks as it says (SGLang: one per tensor-parallel GPU),
        # numbered after the trainer's rank 0 and the engines before it.
        sizes = [max(1, self.engine_caps[i].broadcast_ranks) for i in members]
        offsets = [1 + sum(sizes[:k]) for k in range(len(members))]
        world = 1 + sum(sizes)
        port = self.trainer.init_weight_update_group(name, world, backend, self.timeout_s)
        host = self.trainer.address.rsplit(":", 1)[0]
        joins = [  # (gRPC futures: every member joins at once, however many there are)
            self.engines[i].init_weight_update_group_async(host, port, offset, world, name, backend, self.timeout_s)
            for offset, i in zip(offsets, members)
        ]
        for fut in joins:
            fut.result()
        self._group = _Group(name, members)
        return self._group

    def _drop_group(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        for client in (self.trainer, *(self.engines[i] for i in group.members)):
            self._pool.submit(_destroy_quietly, client, group.name)  # a stalled member must not hold us



    def close(self) -> None:
        self._drop_group()


def _destroy_quietly(client, name: str) -> None:
    try:
        client.destroy_weight_update_group(name)
    except PeerError:
        pass  # a dead member has nothing left to destroy
