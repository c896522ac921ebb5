"""Give a model's device memory back and take it again, keeping every tensor object valid.

A tensor's storage is resized to zero bytes (its shape, the module's and the optimizer's
references stay as they are) and resized back later; the values in between are undefined and
must be restored by the caller. On CUDA the cached blocks are then returned to the device, so
another process (a colocated rollout engine, say) can use the memory. Trainer and rollout both
release memory this way.
"""

from __future__ import annotations

import torch


def make_resizable(tensors: list[torch.Tensor]) -> None:
    """Weights loaded from a file may sit in a fixed-size (mapped) storage: give them their own."""
    with torch.no_grad():
        for t in tensors:
            if not t.untyped_storage().resizable():
                t.data = t.data.clone()


def drop_fixed_storage(tensors: list[torch.Tensor]) -> None:
    """Tensors in a fixed-size storage (an adopted shared-memory segment, a mapped file) cannot
    be resized: give them fresh, untouched storage of their size and drop their values."""
    with torch.no_grad():
        for t in tensors:
            if not t.untyped_storage().resizable():
                t.data = torch.empty_like(t.data)


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def release(tensors: list[torch.Tensor]) -> list[int]:
    """Free the tensors' storage; returns the sizes `reallocate` needs."""
    sizes = [storage_bytes(t) for t in tensors]
    for t in tensors:
        t.untyped_storage().resize_(0)
    if tensors and tensors[0].device.type == "cuda":
        torch.cuda.empty_cache()
    return sizes


def reallocate(tensors: list[torch.Tensor], sizes: list[int]) -> None:
    for t, size in zip(tensors, sizes):
        t.untyped_storage().resize_(size)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def share_one_storage(tensors: list[torch.Tensor], align: int = 256) -> None:
    """Move the tensors' values into one freshly allocated storage (each keeps its dtype and shape).

    Releasing one storage is one free on the device instead of one per tensor: on an H200,
    freeing ~280 separate segments cost 18 ms of a 146 ms Sleep."""
    if not tensors:
        return
    slots = regions([t.numel() * t.element_size() for t in tensors], tensors[0].device, align)
    with torch.no_grad():
        for t, slot in zip(tensors, slots):
            _move_into(t, slot)


def unique_storages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per distinct storage (tensors sharing a storage are released together)."""
    seen, out = set(), []
    for t in tensors:
        key = t.untyped_storage()._cdata  # noqa: SLF001 (identity of the StorageImpl)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def regions(region_bytes: list[int], device: torch.device, align: int = 256) -> list[torch.Tensor]:
    """Consecutive flat uint8 regions of one new zeroed storage, each starting on an `align` boundary."""
    starts, total = [], 0
    for nbytes in region_bytes:
        starts.append(total)
        total += (nbytes + align - 1) // align * align
    flat = torch.zeros(max(total, 1), dtype=torch.uint8, device=device)
    return [flat[start : start + nbytes] for start, nbytes in zip(starts, region_bytes)]


def lay_out(tensors: dict[str, torch.Tensor], placement: list[list[tuple[str, int]]], region_bytes: list[int],
            align: int = 256) -> list[torch.Tensor]:
    """Move named tensors into one new storage made of consecutive regions.

    `placement[k]` lists (name, byte offset inside region k); region k is `region_bytes[k]` long and
    starts at the next `align` boundary after region k-1. Returns the regions as flat uint8 views,
    so whatever reads a region reads the tensors in place. Gaps are zero.
    """
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    flats = regions(region_bytes, device, align)
    with torch.no_grad():
        for flat, region in zip(flats, placement):
            for name, offset in region:
                t = tensors[name]
                _move_into(t, flat[offset : offset + t.numel() * t.element_size()])
    return flats


def _move_into(t: torch.Tensor, slot: torch.Tensor) -> None:
    """Copy t's values into the uint8 `slot` and make t a view of it (same dtype and shape)."""
    view = slot.view(t.dtype).view(t.shape)
    view.copy_(t)
    t.data = view
