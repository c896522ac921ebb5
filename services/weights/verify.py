"""Check received buckets against their manifest's fingerprints before anything is loaded."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from services.weights.buckets import Manifest
from services.weights.errors import FingerprintMismatch, WeightSyncError
from services.weights.fingerprint import FINGERPRINT_ALGOS, fingerprints


def verify_buckets(
    manifest: Manifest,
    buffers: Sequence[torch.Tensor],
    algo: Optional[str] = None,
    computed: Optional[Sequence[str]] = None,
) -> None:
    """Raise FingerprintMismatch naming the first bucket whose bytes do not match the manifest.

    `computed` holds fingerprints of the buffers already made with the manifest's algo (hashed
    while they arrived); they are compared instead of hashing the buffers again."""
    algo = algo or manifest.fingerprint_algo
    if algo not in FINGERPRINT_ALGOS:
        raise ValueError(f"unknown verify_algo {algo!r} (known: {', '.join(FINGERPRINT_ALGOS)})")
    if len(buffers) != len(manifest.buckets):
        raise WeightSyncError(f"received {len(buffers)} buckets, the manifest has {len(manifest.buckets)}")
    for bucket in manifest.buckets:
        if not bucket.fingerprint.startswith(algo + ":"):
            raise WeightSyncError(
                f"bucket {bucket.index} carries fingerprint {bucket.fingerprint!r}, which cannot be verified with {algo!r}"
            )
    if computed is None or algo != manifest.fingerprint_algo:  # on a GPU: one host sync for all
        computed = fingerprints([buffer[: bucket.nbytes] for bucket, buffer in zip(manifest.buckets, buffers)], algo)
    for bucket, actual in zip(manifest.buckets, computed):
        if actual != bucket.fingerprint:
            raise FingerprintMismatch(
                f"bucket {bucket.index} fingerprint mismatch: manifest {bucket.fingerprint}, received {actual}"
            )
