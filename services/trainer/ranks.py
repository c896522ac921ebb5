"""Trainer ranks that are one model: the rendezvous, and how a batch is split and put back.

N trainer processes (pods) form one `torch.distributed` default group (gloo on CPU, NCCL on
GPUs). Rank 0 opens the rendezvous store on a port it picks (`open_store`) and hands it back to
the coordinator, which then configures every rank at once with rank 0's address; `join` blocks
until all ranks are in. The coordinator sends every rank the whole batch (SPMD): `DataParallel`
gives each data-parallel rank a contiguous shard, sums the gradients, metrics and per-token
values the shards produced, and so one step over N ranks equals the one-rank step on the same
batch. Collectives carry a timeout, so a rank that dies mid-step fails the step on the others
instead of holding their server threads forever.
"""

from __future__ import annotations

import datetime
import logging
import math

import torch
import torch.distributed as dist


log = logging.getLogger("rlfleet.trainer")
MAX_RANKS = 1024


class RankError(RuntimeError):
    """The rank group could not form, or a collective over it failed (a rank died or stalled)."""


def _timeout(timeout_s: float) -> datetime.timedelta:
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= 86400):
        raise ValueError(f"ranks.timeout_s: must be seconds in (0, 86400], got {timeout_s}")
    return datetime.timedelta(seconds=timeout_s)


def open_store(world_size: int, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """Rank 0's rendezvous store on `port` (0: a free one; `.port` says which); it lives as long
    as the group. A fixed port lets a NetworkPolicy name it."""
    if not 2 <= world_size <= MAX_RANKS:
        raise ValueError(f"world_size: a rank group has 2 to {MAX_RANKS} ranks, got {world_size}")
    return dist.TCPStore("0.0.0.0", port, world_size, is_master=True, timeout=_timeout(timeout_s),
                         wait_for_workers=False)


def join(*, rank: int, world_size: int, address: str, store: dist.TCPStore | None, backend: str,
         timeout_s: float) -> None:
    """Make this process rank `rank` of the default group; blocks until every rank has joined.

    Rank 0 passes the store it opened; the others connect to `address` ("host:port")."""
    if not 2 <= world_size <= MAX_RANKS:
        raise ValueError(f"ranks.world_size: must be in [2, {MAX_RANKS}], got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"ranks.rank: {rank} is outside the group of {world_size}")
    timeout = _timeout(timeout_s)
    leave()
    try:
        if store is None:
            if rank == 0:
                raise ValueError("ranks: rank 0 has no store; call OpenRankGroup on it first")
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"ranks.address: expected host:port of rank 0's store, got {address!r}")
            store = dist.TCPStore(host.strip("[]"), int(port), world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=dist.PrefixStore("rlfleet-ranks", store), rank=rank,
                                world_size=world_size, timeout=timeout)
        dist.barrier()  # every rank is in: Configure returns on all of them or on none
    except (RuntimeError, OSError) as e:  # torch's DistError types are RuntimeErrors
        leave()
        raise RankError(f"ranks: rank {rank} of {world_size} could not form the group at {address or 'rank 0'} "
                        f"within {timeout_s:g} s: {' '.join(str(e).split())[:300]}") from e
    log.info("rank %d of %d joined the trainer group (%s)", rank, world_size, backend)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world() -> tuple[int, int]:
    """(rank, size) of this process in the trainer group; (0, 1) when it trains alone."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


class DataParallel:
    """Data-parallel arithmetic over `group` (None with one rank: every call is the identity)."""

    def __init__(self, group=None, device: torch.device | str = "cpu"):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        # gloo reduces CPU tensors, NCCL device tensors
        self.device = torch.device(device) if group is not None and dist.get_backend(group) == "nccl" else torch.device("cpu")

    def shard(self, count: int) -> slice:
        """This rank's contiguous share of `count` samples (the first ranks take one more)."""
        base, extra = divmod(count, self.size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def _all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size == 1:
            return tensor
        moved = tensor.to(self.device)
        try:
            dist.all_reduce(moved, op=op, group=self.group)
        except RuntimeError as e:
            raise RankError(f"ranks: a data-parallel all-reduce failed (a rank died or stalled): {e}") from e
        return moved.to(tensor.device)

    def sum_gradients(self, params: list[torch.Tensor], bucket_numel: int = 64 << 20) -> None:
        """Every rank ends with the sum of all ranks' gradients (None counts as zeros)."""
        if self.size == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        start = 0
        while start < len(params):  # a few large all-reduces, not one per parameter
            end, numel = start, 0
            while end < len(params) and (end == start or numel + params[end].numel() <= bucket_numel):
                numel += params[end].numel()
                end += 1
            group = params[start:end]
            flat = torch.cat([p.grad.reshape(-1).float() for p in group])
            flat = self._all_reduce(flat)
            offset = 0
            for p in group:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
            start = end

    def combine_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """Weighted sums add up; `*_max` metrics take the maximum. Every rank must have the same keys."""
        if self.size == 1:
            return sums
        keys = sorted(sums)
        added = [k for k in keys if not k.endswith("_max")]
        maxed = [k for k in keys if k.endswith("_max")]
        out = {}
        if added:
            values = self._all_reduce(torch.tensor([sums[k] for k in added], dtype=torch.float64))
            out.update(zip(added, values.tolist()))
        if maxed:
            values = self._all_reduce(torch.tensor([sums[k] for k in maxed], dtype=torch.float64), dist.ReduceOp.MAX)
            out.update(zip(maxed, values.tolist()))
        return out

    def gather_values(self, lengths: list[int], shard: slice, values: list[list[float]]) -> list[list[float]]:
        """Per-sample value lists for the whole batch, from each rank's lists for its shard."""
        if self.size == 1:
            return values
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        flat = torch.zeros(offsets[-1], dtype=torch.float64)
        for i, row in zip(range(shard.start, shard.stop), values):
            flat[offsets[i] : offsets[i + 1]] = torch.tensor(row, dtype=torch.float64)
        flat = self._all_reduce(flat).tolist()
        return [flat[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
