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
