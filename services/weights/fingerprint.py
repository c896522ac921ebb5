"""Bucket fingerprints: "xxh3" for host bytes, "fast" on the device, "sha256" for exact checks.

"xxh3" is a two-level XXH3-64 tree: the bytes are cut into pieces of `PIECE_BYTES` (16 MiB),
each piece is hashed, and the fingerprint is the XXH3-64 of the byte length followed by the
piece digests (little-endian uint64 each). Pieces are independent, so a bucket is hashed by
every core at once (55 GB/s on this 2-core machine against 32 on one core), a copy can hash
each piece while it is still in cache (`copy_and_fingerprint`), and a receiver can hash the
pieces that have already arrived while the rest is in flight (`IncrementalFingerprint`).
Device buckets use "fast" so that nothing crosses PCIe just to be checked; on a GPU with Triton
it runs in one pass over the bytes (`fast_cuda.py`).

Engines verify every bucket before a new weight version becomes visible, so the check runs on
each sync and must cost little next to the transfer itself. "fast" runs where the bucket lives
(GPU or CPU) with plain integer tensor ops and moves only two scalars to the host.

"fast" reads the bytes as little-endian int32 words x, zero-padded to whole rows of
`_ROW_WORDS`, and computes, with wrap-around int64 arithmetic,

    s0 = sum_i x_i
    s1 = sum_k v_k * sum_j w_j * x[k, j]      w_j = C1 + S1*j,  v_k = C2 + S2*k

(k the row, j the column; C odd, S twice an odd number). Every w_j and v_k is odd, so changing
one word by d != 0 moves s1 by an odd multiple of d, which is never 0 mod 2^64; swapping two
different words in one row or in one column moves it by d * odd * S * distance, which has
fewer than 64 factors of two in any bucket under 16 TiB, so those swaps are always caught;
other swaps and multi-word damage are caught unless they cancel mod 2^64. Modular sums do not
depend on reduction order, so CPU and GPU agree bit for bit. The byte length is part of the
result, so zero padding cannot collide with real zero bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xxhash

from services.weights import fast_cuda
from services.weights.buckets import host_bytes

__all__ = [
    "FINGERPRINT_ALGOS", "PIECE_BYTES", "IncrementalFingerprint", "copy_and_fingerprint", "default_algo",
    "fingerprint", "fingerprint_algo", "fingerprints",
]

FINGERPRINT_ALGOS = ("fast", "xxh3", "sha256")

_ROW_WORDS = 1024  # part of the "fast" definition: changing it changes every fingerprint
_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


# Odd offsets C and slopes S = 2 * odd, from splitmix64's constants (any such choice works).
_C1 = _signed64(0x9E3779B97F4A7C15)
_S1 = _signed64(0xBF58476D1CE4E5B9 << 1)
_C2 = _signed64(0xD6E8FEB86659FD93)
_S2 = _signed64(0x94D049BB133111EB << 1)

# Rows per step: small on CPU so the int64 scratch stays in cache, large on GPU to keep the
# number of kernel launches low. The result does not depend on it.
_CPU_ROWS_PER_STEP = 64
_GPU_ROWS_PER_STEP = 16384


def fingerprint(flat: torch.Tensor, algo: str = "fast") -> str:
    """Fingerprint of a flat uint8 tensor as "<algo>:<hex>"."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(
            f"fingerprint needs a 1-D uint8 tensor, got {flat.dtype} with shape {list(flat.shape)}"
        )
    if algo == "fast":
        if fast_cuda.available(flat):
            return fast_cuda.fingerprints([flat])[0]
        return "fast:" + _fast(flat)
    if algo == "xxh3":
        data = host_bytes(flat.detach().contiguous().cpu())
        return _xxh3_tree(len(data), [f.result() for f in _hash_pieces(data, range(_num_pieces(len(data))))])
    if algo == "sha256":
        # Exact, host-side, for tests and debugging: copies the bytes to the host.
        return "sha256:" + hashlib.sha256(host_bytes(flat.detach().contiguous().cpu())).hexdigest()
    raise ValueError(f"unknown fingerprint algo {algo!r} (known: {', '.join(FINGERPRINT_ALGOS)})")


def fingerprints(flats, algo: str = "fast") -> list[str]:
    """`fingerprint` of each flat uint8 tensor; "fast" on a GPU waits for the device once for all."""
    flats = list(flats)
    if algo == "fast" and flats and all(fast_cuda.available(f) for f in flats):
        return fast_cuda.fingerprints(flats)
    return [fingerprint(f, algo) for f in flats]


def default_algo(device: torch.device | str) -> str:
    """The cheap algorithm for bytes that live on `device`."""
    return "xxh3" if torch.device(device).type == "cpu" else "fast"


def fingerprint_algo(value: str) -> str:
    """The algo named by a "<algo>:<hex>" fingerprint; ValueError if malformed or unknown."""
    algo, sep, digest = value.partition(":")
    if not sep or not digest or algo not in FINGERPRINT_ALGOS:
        raise ValueError(f"malformed fingerprint {value!r}: expected '<algo>:<hex>'")
    return algo


# ---- xxh3 tree ----------------------------------------------------------------------------------
PIECE_BYTES = 16 << 20  # part of the "xxh3" definition: changing it changes every fingerprint
_COPY_STEP = 256 << 10  # copy-and-hash step: small enough that the hash reads from cache
_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _hash_pool() -> ThreadPoolExecutor:
    """One thread per core, shared by every hash in the process (XXH3 releases the GIL)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="rlfleet-hash")
        return _pool


def _num_pieces(nbytes: int) -> int:
    return max(1, -(-nbytes // PIECE_BYTES))


def _piece(data: memoryview, k: int) -> memoryview:
    return data[k * PIECE_BYTES : (k + 1) * PIECE_BYTES]


def _hash_pieces(data: memoryview, pieces) -> list[Future]:
    pool = _hash_pool()
    return [pool.submit(xxhash.xxh3_64_intdigest, _piece(data, k)) for k in pieces]


def _xxh3_tree(nbytes: int, digests: list[int]) -> str:
    return "xxh3:" + xxhash.xxh3_64_hexdigest(struct.pack(f"<{1 + len(digests)}Q", nbytes, *digests))


def copy_and_fingerprint(dst: torch.Tensor, src: torch.Tensor) -> str:
    """Copy a flat uint8 CPU tensor into another of the same size and return the copy's "xxh3"
    fingerprint, hashing each step right after copying it (from cache, not from memory again).
    Pieces run on every core: about as fast as a plain copy of the same bytes."""
    if not all(t.device.type == "cpu" and t.dtype == torch.uint8 and t.is_contiguous() for t in (dst, src)) \
            or dst.numel() != src.numel():
        raise ValueError(
            f"copy_and_fingerprint: needs two contiguous uint8 CPU tensors of one size, got {dst.numel()} and {src.numel()}"
        )
    out = host_bytes(dst)  # what the hash reads
    dst_ptr, src_ptr, nbytes = dst.data_ptr(), src.data_ptr(), len(out)

    def piece(k: int) -> int:
        hasher = xxhash.xxh3_64()
        for start in range(k * PIECE_BYTES, min((k + 1) * PIECE_BYTES, nbytes), _COPY_STEP):
            stop = min(start + _COPY_STEP, (k + 1) * PIECE_BYTES, nbytes)
            ctypes.memmove(dst_ptr + start, src_ptr + start, stop - start)
            hasher.update(out[start:stop])
        return hasher.intdigest()

    futures = [_hash_pool().submit(piece, k) for k in range(_num_pieces(nbytes))]
    return _xxh3_tree(nbytes, [f.result() for f in futures])


class IncrementalFingerprint:
    """The "xxh3" fingerprint of a buffer that fills front to back (a stream, a broadcast in
    parts): `filled(n)` says the first n bytes are final, and every piece they complete is hashed
    in the background while the rest arrives; `result()` waits for the last ones."""

    def __init__(self, flat: torch.Tensor):
        self._data = host_bytes(flat)
        self._hashed = 0  # pieces submitted
        self._futures: list[Future] = []

    def filled(self, nbytes: int) -> None:
        total = len(self._data)
        complete = _num_pieces(total) if nbytes >= total else nbytes // PIECE_BYTES
        if complete > self._hashed:
            self._futures += _hash_pieces(self._data, range(self._hashed, complete))
            self._hashed = complete

    def result(self) -> str:
        self.filled(len(self._data))
        return _xxh3_tree(len(self._data), [f.result() for f in self._futures])


def _fast(flat: torch.Tensor) -> str:
    flat = flat.detach()
    if not flat.is_contiguous() or flat.storage_offset() % 4:
        flat = flat.clone()  # int32 views need 4-byte alignment; rare, costs one copy
    num_bytes = flat.numel()
    row_bytes = 4 * _ROW_WORDS
    num_full_rows = num_bytes // row_bytes
    device = flat.device

    rows = flat[: num_full_rows * row_bytes].view(torch.int32).view(num_full_rows, _ROW_WORDS)
    tail_bytes = num_bytes - num_full_rows * row_bytes
    if tail_bytes:
        tail = torch.zeros(row_bytes, dtype=torch.uint8, device=device)
        tail[:tail_bytes].copy_(flat[num_full_rows * row_bytes :])
        tail_row = tail.view(torch.int32).view(1, _ROW_WORDS)
    num_rows = num_full_rows + (1 if tail_bytes else 0)

    col_weights = torch.arange(_ROW_WORDS, dtype=torch.int64, device=device) * _S1 + _C1  # [W]
    row_sums = torch.empty(num_rows, dtype=torch.int64, device=device)  # [R] sum_j w_j x[k, j]
    s0 = torch.zeros((), dtype=torch.int64, device=device)
    step = _GPU_ROWS_PER_STEP if device.type != "cpu" else _CPU_ROWS_PER_STEP
    scratch = torch.empty(min(step, max(num_rows, 1)), _ROW_WORDS, dtype=torch.int64, device=device)
    for start in range(0, num_rows, step):
        stop = min(start + step, num_rows)
        block = rows[start:stop] if stop <= num_full_rows else _with_tail(rows[start:], tail_row)
        s0 += block.sum(dtype=torch.int64)
        words = torch.mul(block, col_weights, out=scratch[: stop - start])  # [r, W] int64, one pass
        torch.sum(words, dim=1, out=row_sums[start:stop])
    row_weights = torch.arange(num_rows, dtype=torch.int64, device=device) * _S2 + _C2  # [R]
    s1 = (row_sums * row_weights).sum()
    sums = torch.stack([s0, s1]).tolist()  # one device->host sync for both scalars
    return f"{num_bytes:016x}{sums[0] & _MASK64:016x}{sums[1] & _MASK64:016x}"


def _with_tail(full_rows: torch.Tensor, tail_row: torch.Tensor) -> torch.Tensor:
    # Only the last step sees the tail: a copy of at most one step of rows.
    return torch.cat([full_rows, tail_row])
