"""Swap received weights into a model: the last step of every data plane.

Callers verify first (fingerprints, `validate_against`); `load_buckets_into` then re-checks
that every tensor it is about to write has a target of the same dtype and shape, *before* the
first copy, so a bad update leaves the model untouched rather than half-written.
`named_weights` is the single definition of "what a checkpoint holds" that both the sender's
bucket plan and the receiver's target dict are built from.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from services.weights.buckets import Manifest, memcpy, parse_dtype, unpack_bucket
from services.weights.errors import ManifestMismatch

__all__ = ["adoption_plan", "load_buckets_into", "named_weights"]


def named_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers, in `state_dict` order, each tensor once.

    Tied parameters (and modules registered under two names) keep their first name, as
    `named_parameters()` does; non-persistent buffers are left out, as a checkpoint leaves them.
    """
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor]] = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor) or id(tensor) in seen:
            continue  # extra state objects; second names of tied weights
        seen.add(id(tensor))
        named.append((name, tensor))
    return named


def adoption_plan(
    model_params: Mapping[str, torch.Tensor], manifest: Manifest, buffers: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model tensor, its view in `buffers`) for every tensor of the manifest, after checking that
    each has a target of the same dtype and shape: nothing is written until all of them pass."""
    if len(buffers) != len(manifest.buckets):
        raise ManifestMismatch(f"{len(manifest.buckets)} buckets but {len(buffers)} buffers")
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    for bucket, flat in zip(manifest.buckets, buffers):
        dtype = parse_dtype(bucket.dtype)
        for ts in bucket.tensors:
            target = model_params.get(ts.name)
            if target is None:
                raise ManifestMismatch(f"tensor {ts.name!r} (bucket {bucket.index}) is not in the model")
            if target.dtype != dtype or tuple(target.shape) != ts.shape:
                held = f"{str(target.dtype).removeprefix('torch.')}{list(target.shape)}"
                raise ManifestMismatch(
                    f"tensor {ts.name!r} (bucket {bucket.index}) is {bucket.dtype}{list(ts.shape)}, the model holds {held}"
                )
        try:
            unpacked = unpack_bucket(bucket, flat)
        except ValueError as e:
            raise ManifestMismatch(str(e)) from e
        plan.extend((model_params[ts.name], unpacked[ts.name]) for ts in bucket.tensors)
    return plan


def load_buckets_into(
    model_params: Mapping[str, torch.Tensor],
    manifest: Manifest,
    buffers: Sequence[torch.Tensor],
    *,
    adopt: bool = False,
    plan: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> int:
    """Copy every tensor of the verified `buffers` (one flat uint8 per bucket) into the
    same-named entry of `model_params`; returns the bytes loaded.

    With `adopt` nothing is copied: each tensor is re-pointed at its slice of the buffers, which
    from then on belong to the model (the caller must not reuse them while the model does).
    `plan` is `adoption_plan(model_params, manifest, buffers)` made earlier, if the caller kept it.

    Tensors of the model that the manifest does not name are left alone: whether the manifest
    must cover the whole model is `validate_against`'s decision.
    """
    views = plan if plan is not None else adoption_plan(model_params, manifest, buffers)
    num_bytes = 0
    with torch.no_grad():
        for target, source in views:
            if adopt:
                target.data = source
            else:
                copy_bytes_(target, source)
            num_bytes += source.numel() * source.element_size()
    return num_bytes


def copy_bytes_(target: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> None:
    """target.copy_(source) for same-dtype tensors, as a plain byte copy when both are contiguous.

    On CPU, torch hands a copy of a few MB to its OpenMP team, which measured 1.4-1.9 GB/s on
    this 2-core machine where a single-threaded memcpy of the same bytes ran at 20 GB/s. (A
    memmove rather than numpy: exporting a tensor to numpy pins its storage's size, and Sleep
    must be able to resize parameter storage.)"""
    if not (target.is_contiguous() and source.is_contiguous() and target.dtype == source.dtype):
        target.copy_(source, non_blocking=non_blocking)
        return
    dst, src = target.view(-1).view(torch.uint8), source.reshape(-1).view(torch.uint8)
    if dst.device.type == "cpu" and src.device.type == "cpu":
        memcpy(dst, src)
    else:
        dst.copy_(src, non_blocking=non_blocking)
