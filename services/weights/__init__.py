"""Weight sync between trainers and rollout engines: buckets, manifests, fingerprints, planes.

The trainer flattens its weights into large per-dtype buckets (`buckets`), describes them in a
`Manifest` with one fingerprint per bucket (`fingerprint`, `manifest`), and sends them over a
data plane (`grpc_stream` here; broadcast, CUDA IPC and shared memory alongside). The engine
checks the manifest against its model, receives and verifies every bucket, and only then
copies the weights in (`apply`). Nothing here starts a server or imports trainer or rollout.
"""

from services.weights.apply import load_buckets_into, named_weights
from services.weights.buckets import (
    ALIGN_BYTES,
    DEFAULT_BUCKET_BYTES,
    BucketSpec,
    Manifest,
    TensorSpec,
    dtype_name,
    pack_bucket,
    parse_dtype,
    plan_buckets,
    unpack_bucket,
)
from services.weights.errors import (
    FingerprintMismatch,
    IncompleteTransfer,
    InvalidChunk,
    ManifestMismatch,
    WeightSyncError,
)
from services.weights.fingerprint import FINGERPRINT_ALGOS, fingerprint
from services.weights.grpc_stream import DEFAULT_CHUNK_BYTES, StreamReceiver, iter_chunks, receive
from services.weights.manifest import (
    expected_layout,
    make_manifest,
    manifest_from_proto,
    manifest_to_proto,
    validate_against,
)

__all__ = [
    "ALIGN_BYTES",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "FINGERPRINT_ALGOS",
    "BucketSpec",
    "FingerprintMismatch",
    "IncompleteTransfer",
    "InvalidChunk",
    "Manifest",
    "ManifestMismatch",
    "StreamReceiver",
    "TensorSpec",
    "WeightSyncError",
    "dtype_name",
    "expected_layout",
    "fingerprint",
    "iter_chunks",
    "load_buckets_into",
    "make_manifest",
    "manifest_from_proto",
    "manifest_to_proto",
    "named_weights",
    "pack_bucket",
    "parse_dtype",
    "plan_buckets",
    "receive",
    "unpack_bucket",
    "validate_against",
]
