"""Flat weight buckets: plan the layout, pack tensors into one uint8 buffer, unpack as views.

Every data plane moves weights as a few large flat buffers rather than hundreds of small
tensors, because per-message and per-collective overheads dominate small transfers. A bucket
holds tensors of one dtype only, so the receiver can view its slots without conversion; each
slot starts on a 256-byte boundary so those views are aligned for any dtype and vector width.
Packing and unpacking never change device: a GPU bucket stays on the GPU.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

import torch

__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "TensorSpec",
    "BucketSpec",
    "Manifest",
    "dtype_name",
    "parse_dtype",
    "align_up",
    "plan_buckets",
    "pack_bucket",
    "unpack_bucket",
]

ALIGN_BYTES = 256
DEFAULT_BUCKET_BYTES = 512 << 20

# Wire names of the dtypes a checkpoint may hold (floating weights plus integer / bool buffers).
_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float16", "bfloat16", "float64",
        "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
    if hasattr(torch, name)
}
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"; ValueError for dtypes that cannot travel in a bucket."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported in weight buckets") from None


def parse_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> `torch.bfloat16`; ValueError naming an unknown dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        known = ", ".join(sorted(_DTYPES))
        raise ValueError(f"unknown dtype {name!r} (known: {known})") from None


def align_up(num_bytes: int, align: int = ALIGN_BYTES) -> int:
    return (num_bytes + align - 1) // align * align


@dataclass(frozen=True)
class TensorSpec:
    """Where one named tensor lives inside its bucket."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BucketSpec:
    """One flat run of bytes holding tensors of a single dtype."""

    index: int
    dtype: str
    tensors: tuple[TensorSpec, ...]
    nbytes: int
    fingerprint: str = ""  # "<algo>:<hex>", empty until computed


@dataclass(frozen=True)
class Manifest:
    """A full weight update: which version, read from where, laid out in which buckets."""

    version: int
    source: str  # "gpu" (live weights) or "host" (the host store's actor copy)
    buckets: tuple[BucketSpec, ...]
    fingerprint_algo: str

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[BucketSpec]:
    """Group tensors by dtype (first-seen dtype first, model order within a dtype) and fill
    buckets up to `bucket_bytes`; a tensor larger than that gets a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    by_dtype: dict[str, list[tuple[str, torch.Tensor]]] = {}
    seen: set[str] = set()
    for name, tensor in named:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice")
        seen.add(name)
        by_dtype.setdefault(dtype_name(tensor.dtype), []).append((name, tensor))

    buckets: list[BucketSpec] = []
    for dtype, group in by_dtype.items():
        current: list[TensorSpec] = []
        cursor = 0
        for name, tensor in group:
            nbytes = tensor.numel() * tensor.element_size()
            offset = align_up(cursor)
            if current and offset + nbytes > bucket_bytes:
                buckets.append(_close(len(buckets), dtype, current))
                current, offset = [], 0
            current.append(TensorSpec(name, dtype, tuple(tensor.shape), offset, nbytes))
            cursor = offset + nbytes
        if current:
            buckets.append(_close(len(buckets), dtype, current))
    return buckets


def _close(index: int, dtype: str, tensors: list[TensorSpec]) -> BucketSpec:
    # No trailing padding: the bucket ends where its last tensor ends.
    return BucketSpec(index, dtype, tuple(tensors), tensors[-1].end)


def pack_bucket(
    spec: BucketSpec,
    tensors_by_name: Mapping[str, torch.Tensor],
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Copy each tensor's bytes into its slot of a flat uint8 buffer and return it: [spec.nbytes].

    `out` (uint8, 1-D, at least `spec.nbytes`) is reused when given; otherwise the buffer is
    allocated on the device of the bucket's first tensor. Gaps between slots are zeroed so
    that equal weights always give equal bytes, and therefore equal fingerprints.
    """
    dtype = parse_dtype(spec.dtype)
    if out is None:
        device = tensors_by_name[spec.tensors[0].name].device if spec.tensors else "cpu"
        out = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    else:
        _check_flat(out, spec, "out")
    flat = out[: spec.nbytes]  # [nbytes] uint8
    cursor = 0
    for ts in spec.tensors:
        tensor = tensors_by_name.get(ts.name)
        if tensor is None:
            raise ValueError(f"bucket {spec.index}: tensor {ts.name!r} is missing")
        if tensor.dtype != dtype or tuple(tensor.shape) != ts.shape:
            raise ValueError(
                f"bucket {spec.index}: tensor {ts.name!r} is {dtype_name(tensor.dtype)}"
                f"{list(tensor.shape)}, the bucket expects {spec.dtype}{list(ts.shape)}"
            )
        if ts.offset > cursor:
            flat[cursor : ts.offset].zero_()
        src = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
        _copy(flat[ts.offset : ts.end], src)
        cursor = ts.end
    if spec.nbytes > cursor:
        flat[cursor:].zero_()
    return flat


def unpack_bucket(spec: BucketSpec, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero-copy views of the bucket's tensors, with their dtypes and shapes, into `flat`."""
    _check_flat(flat, spec, "flat")
    dtype = parse_dtype(spec.dtype)
    return {
        ts.name: flat[ts.offset : ts.end].view(dtype).view(ts.shape) for ts in spec.tensors
    }


def _check_flat(flat: torch.Tensor, spec: BucketSpec, what: str) -> None:
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"bucket {spec.index}: {what} must be a contiguous 1-D uint8 tensor, "
            f"got {flat.dtype} with shape {list(flat.shape)}"
        )
    if flat.numel() < spec.nbytes:
        raise ValueError(
            f"bucket {spec.index}: {what} holds {flat.numel()} bytes, "
            f"the bucket needs {spec.nbytes}"
        )


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device.type == "cpu" and src.device.type == "cpu":
        memcpy(dst, src)
    else:
        dst.copy_(src)


def memcpy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a contiguous uint8 CPU tensor into another of the same size with one memmove.

    torch's own CPU copy of a few MB goes through its OpenMP team and measured 10x slower on a
    2-core machine; the memmove releases the GIL and touches no storage flags."""
    if dst.numel() != src.numel() or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"memcpy: {dst.numel()} and {src.numel()} bytes, both must be contiguous")
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())


def host_bytes(flat: torch.Tensor) -> memoryview:
    """A zero-copy memoryview of a contiguous host tensor's bytes.

    Not `tensor.numpy()`: exporting to numpy marks the storage as not resizable, and a trainer
    that sleeps must resize its weight storage to zero."""
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError("host_bytes: needs a contiguous CPU tensor")
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return memoryview(b"")
    raw = (ctypes.c_char * nbytes).from_address(flat.data_ptr())
    raw._owner = flat  # the view keeps the tensor alive (callers often pass a temporary)
    return memoryview(raw).cast("B")
