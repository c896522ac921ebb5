"""KV blocks shared across requests by prefix: a hash chain over full blocks.

A prompt's full blocks (and, when a row finishes, those its prompt and outputs fill) are named
by a chain of digests: block i's key is blake2b of block i-1's
key and the 16 token ids it holds, and block 0's chain starts from the weight version, so a key
names a whole prefix made under one version (a 16-byte digest: a false match is a 2^-64 event,
as with vLLM's hashed blocks). `PrefixCache` maps keys to block ids, holding one reference to each
block in the allocator; a request whose prompt starts with cached blocks takes them (one more
reference each) and prefills only the rest. Blocks that no row holds any more stay cached until
the pool needs them, and go least recently used first.

KV computed under one weight version is never used under another: the keys of one version never
equal another's, and `clear` (every weight update) drops every block the cache holds.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict

import numpy

from services.rollout.builtin.kv_cache import BlockAllocator


def block_keys(prompt_ids, block_size: int, version: int, count: int | None = None,
               known: list[bytes] = ()) -> list[bytes]:
    """The chain keys of the first `count` (default: every) full blocks of `prompt_ids`.
    `known`: the keys of its first blocks, computed before (a finished row's prompt): the chain
    goes on from them, hashing only the blocks after."""
    full = len(prompt_ids) // block_size if count is None else min(count, len(prompt_ids) // block_size)
    keys = list(known[:full])
    if len(keys) == full:
        return keys
    key = keys[-1] if keys else hashlib.blake2b(int(version).to_bytes(8, "little", signed=True),
                                                digest_size=16).digest()
    start = len(keys) * block_size
    raw = numpy.asarray(prompt_ids[start : full * block_size], dtype=numpy.int64).tobytes()  # (one conversion)
    width = block_size * 8
    for at in range(0, len(raw), width):
        key = hashlib.blake2b(key + raw[at : at + width], digest_size=16).digest()
        keys.append(key)
    return keys


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, version: int = 0):
        self.allocator, self.block_size, self.version = allocator, block_size, version
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.lookup_tokens = 0  # prompt tokens looked up, over the cache's life
        self.hit_tokens = 0  # of those, found cached (not prefilled)
        self.evicted = 0  # blocks given back to make room

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self, prompt_ids, count: int | None = None, known: list[bytes] = ()) -> list[bytes]:
        return block_keys(prompt_ids, self.block_size, self.version, count, known)

    def match(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest cached prefix of `keys`, each marked just used. The
        caller takes its references (`allocator.share`) before anything can evict them."""
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            found.append(block)
        return found

    def record(self, prompt_tokens: int, hit_blocks: int) -> None:
        """A prompt admitted with `hit_blocks` of its blocks found cached (the hit rate's counts)."""
        self.lookup_tokens += prompt_tokens
        self.hit_tokens += hit_blocks * self.block_size

    def insert(self, keys: list[bytes], blocks: list[int]) -> None:
        """Cache `blocks` (full, their keys and values written or queued) under `keys`."""
        for key, block in zip(keys, blocks):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self.allocator.share([block])
            self._blocks[key] = block

    def evictable(self) -> int:
        """Blocks only the cache holds: what `evict` can give back."""
        return sum(1 for b in self._blocks.values() if self.allocator.refs(b) == 1)

    def evict(self, count: int) -> int:
        """Give back up to `count` blocks no row holds, least recently used first; returns how many."""
        gone = list(itertools.islice((key for key, b in self._blocks.items() if self.allocator.refs(b) == 1), count))
        self.allocator.free([self._blocks.pop(key) for key in gone])
        self.evicted += len(gone)
        return len(gone)

    def clear(self, version: int | None = None) -> None:
        """Drop every cached block (a weight update: `version` is the new one)."""
        self.allocator.free(list(self._blocks.values()))
        self._blocks.clear()
        if version is not None:
            self.version = version

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
