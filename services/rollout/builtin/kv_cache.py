"""The paged KV cache: every layer's keys and values in one device tensor, handed out in blocks.

Layout [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]. A sequence owns a list
of block ids (its block table); token position p lives in block `table[p // block_size]` at row
`p % block_size`. Shapes never change from step to step, so one captured decode graph serves
any mix of sequence lengths. Block 0 is never handed out: rows that pad a batch to its captured
size (and prompt padding) write there.

The host side (`BlockAllocator`) is plain bookkeeping with reference counts: the n samples of one
prompt share the blocks the prompt fills completely, and `PagedKVCache.copy_blocks` gives each
sample its own copy of a partly filled last prompt block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
TRASH_BLOCK = 0


class KVCacheFull(RuntimeError):
    """Fewer free blocks than asked for (the scheduler waits for sequences to finish)."""


@dataclass(frozen=True, kw_only=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = BLOCK_SIZE

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class BlockAllocator:
    """Free list and reference counts of blocks 1..num_blocks-1."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"kv cache: {num_blocks} blocks is too few (block 0 is reserved)")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise KVCacheFull(f"kv cache: {count} blocks wanted, {len(self._free)} free")
        # The last `count` free ids, last first: what `count` pops hand out, in one slice.
        start = len(self._free) - count
        blocks = self._free[start:][::-1]
        del self._free[start:]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def refs(self, block: int) -> int:
        return self._refs[block]

    def grow(self, num_blocks: int) -> None:
        """Blocks num_blocks.. become free ids (handed out after the free ones, low ids first)."""
        added = list(range(num_blocks - 1, self.num_blocks - 1, -1))
        self._free = added + self._free
        self._refs += [0] * (num_blocks - self.num_blocks)
        self.num_blocks = num_blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self._refs[b] > 0, f"sharing free block {b}"
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        refs, free = self._refs, self._free
        for b in blocks:
            assert refs[b] > 0, f"freeing free block {b}"
            refs[b] -= 1
            if refs[b] == 0:
                free.append(b)


class PagedKVCache:
    """The device tensor and its allocator; `release` frees the memory, `allocate` takes it again."""

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device):
        self.shape, self.num_blocks, self.device = shape, num_blocks, device
        self.allocator = BlockAllocator(num_blocks)
        self.kv: torch.Tensor | None = None
        self.allocate()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

    def allocate(self) -> None:
        """Zeroed, so padding rows and unwritten slots hold finite numbers."""
        s = self.shape
        self.kv = torch.zeros(s.num_layers, 2, self.num_blocks, s.block_size, s.num_kv_heads, s.head_dim,
                              dtype=s.dtype, device=self.device)
        self.allocator = BlockAllocator(self.num_blocks)

    def release(self) -> None:
        self.kv = None

    def grow(self, num_blocks: int) -> None:
        """More blocks, every held one kept where it is with its keys and values (a CPU pool that
        a larger call outgrew: the prefix cache and the rows' tables stay valid)."""
        if num_blocks <= self.num_blocks:
            return
        s = self.shape
        kv = torch.zeros(s.num_layers, 2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype,
                         device=self.device)
        if self.kv is not None:
            kv[:, :, : self.num_blocks] = self.kv
        self.kv = kv
        self.allocator.grow(num_blocks)
        self.num_blocks = num_blocks

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one layer as [num_blocks * block_size, num_kv_heads, head_dim] views."""
        assert self.kv is not None, "kv cache is released"
        kv = self.kv[index]
        s = self.shape
        return kv[0].view(-1, s.num_kv_heads, s.head_dim), kv[1].view(-1, s.num_kv_heads, s.head_dim)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Block dst[i] of every layer takes block src[i]'s keys and values (one indexed copy)."""
        if src:
            index_src, index_dst = to_device(torch.tensor([src, dst]), self.device)
            self.kv[:, :, index_dst] = self.kv[:, :, index_src]


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`. On a GPU it goes through pinned memory and does not
    block: a copy from pageable memory waits for all the work queued before it (a prefill just
    queued, say) and leaves the device idle while the host catches up. The pinned buffer is not
    reused before the copy is done (PyTorch's host allocator waits for it)."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def blocks_in_budget(shape: KVShape, budget_bytes: int) -> int:
    return max(0, budget_bytes // shape.bytes_per_block)
