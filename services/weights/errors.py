"""Typed errors of the weight-sync path.

Callers map them onto the wire: `ManifestMismatch` and `InvalidChunk` are the sender's or the
user's mistake (INVALID_ARGUMENT); `WeightSyncError` and its subclasses mean a transfer failed
or arrived damaged, and the engine must not serve the weights it was building.
"""

from __future__ import annotations

__all__ = [
    "WeightSyncError",
    "FingerprintMismatch",
    "IncompleteTransfer",
    "ManifestMismatch",
    "InvalidChunk",
]


class WeightSyncError(RuntimeError):
    """A weight transfer failed; the received weights must not be used."""


class FingerprintMismatch(WeightSyncError):
    """A bucket arrived complete but its bytes do not match the manifest's fingerprint."""


class IncompleteTransfer(WeightSyncError):
    """A transfer ended before every byte of every bucket arrived."""


class ManifestMismatch(ValueError):
    """A manifest is malformed or does not describe the model it is meant for."""


class InvalidChunk(ValueError):
    """A `WeightChunk` names an unknown bucket, runs past its end, or overlaps earlier data."""
