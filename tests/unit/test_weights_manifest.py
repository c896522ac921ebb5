"""Manifest proto round trip and `validate_against`, one test per kind of mismatch."""

import dataclasses

import pytest
import torch

from services.api import weights_pb2
from services.weights.buckets import BucketSpec, Manifest, TensorSpec, pack_bucket, plan_buckets
from services.weights.errors import ManifestMismatch
from services.weights.manifest import (
    expected_layout,
    make_manifest,
    manifest_from_proto,
    manifest_to_proto,
    validate_against,
)


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(16, 8, generator=g).to(torch.bfloat16)),
        ("layer.0.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),
        ("layer.0.bias", torch.randn(8, generator=g)),
        ("norm.weight", torch.randn(8, generator=g)),
    ]


@pytest.fixture
def manifest() -> Manifest:
    named = _named()
    buckets = plan_buckets(named)
    flats = [pack_bucket(b, dict(named)) for b in buckets]
    return make_manifest(7, "host", buckets, flats)


def _edit_tensor(manifest: Manifest, name: str, **changes) -> Manifest:
    buckets = []
    for b in manifest.buckets:
        tensors = tuple(
            dataclasses.replace(t, **changes) if t.name == name else t for t in b.tensors
        )
        buckets.append(dataclasses.replace(b, tensors=tensors))
    return dataclasses.replace(manifest, buckets=tuple(buckets))


def _edit_bucket(manifest: Manifest, position: int, **changes) -> Manifest:
    buckets = list(manifest.buckets)
    buckets[position] = dataclasses.replace(buckets[position], **changes)
    return dataclasses.replace(manifest, buckets=tuple(buckets))


def test_proto_round_trip(manifest):
    msg = manifest_to_proto(manifest)
    assert msg.total_bytes == manifest.total_bytes
    assert msg.buckets[0].tensors[0].shape == [16, 8]
    wire = weights_pb2.WeightManifest.FromString(msg.SerializeToString())
    assert manifest_from_proto(wire) == manifest
    assert all(b.fingerprint.startswith("fast:") for b in manifest.buckets)


def test_proto_total_bytes_must_agree(manifest):
    msg = manifest_to_proto(manifest)
    msg.total_bytes += 1
    with pytest.raises(ManifestMismatch, match="total_bytes"):
        manifest_from_proto(msg)


def test_matching_layout_passes(manifest):
    validate_against(manifest, expected_layout(_named()))


def test_missing_tensor(manifest):
    expected = expected_layout(_named())
    expected["lm_head.weight"] = ("bfloat16", (16, 8))
    with pytest.raises(ManifestMismatch, match="'lm_head.weight' is missing"):
        validate_against(manifest, expected)


def test_unexpected_tensor(manifest):
    expected = expected_layout(_named())
    del expected["layer.0.bias"]
    with pytest.raises(ManifestMismatch, match="'layer.0.bias'.*unexpected"):
        validate_against(manifest, expected)


def test_wrong_shape(manifest):
    expected = expected_layout(_named())
    expected["layer.0.weight"] = ("bfloat16", (8, 9))
    with pytest.raises(ManifestMismatch, match=r"'layer.0.weight'.*shape \[8, 8\].*\[8, 9\]"):
        validate_against(manifest, expected)


def test_wrong_dtype(manifest):
    expected = expected_layout(_named())
    expected["norm.weight"] = ("bfloat16", (8,))
    with pytest.raises(ManifestMismatch, match="'norm.weight'.*float32.*bfloat16"):
        validate_against(manifest, expected)


def test_bucket_nbytes_too_small_for_its_tensors(manifest):
    bad = _edit_bucket(manifest, 0, nbytes=manifest.buckets[0].nbytes - 2)
    with pytest.raises(ManifestMismatch, match="'layer.0.weight'.*past the bucket's nbytes"):
        validate_against(bad, expected_layout(_named()))


def test_bucket_nbytes_larger_than_its_tensors(manifest):
    bad = _edit_bucket(manifest, 1, nbytes=manifest.buckets[1].nbytes + 4096)
    with pytest.raises(ManifestMismatch, match="bucket 1 has nbytes"):
        validate_against(bad, expected_layout(_named()))


def test_overlapping_offsets(manifest):
    bad = _edit_tensor(manifest, "layer.0.weight", offset=128)  # embed occupies [0, 256)
    with pytest.raises(ManifestMismatch, match="'layer.0.weight'.*overlaps"):
        validate_against(bad, expected_layout(_named()))


def test_negative_offset(manifest):
    bad = _edit_tensor(manifest, "norm.weight", offset=-256)
    with pytest.raises(ManifestMismatch, match="'norm.weight'.*offset -256"):
        validate_against(bad, expected_layout(_named()))


def test_tensor_nbytes_inconsistent_with_shape(manifest):
    bad = _edit_tensor(manifest, "layer.0.bias", nbytes=16)
    with pytest.raises(ManifestMismatch, match="'layer.0.bias'.*nbytes 16.*takes 32"):
        validate_against(bad, expected_layout(_named()))


def test_tensor_dtype_differs_from_its_bucket(manifest):
    bad = _edit_tensor(manifest, "layer.0.bias", dtype="float16")
    with pytest.raises(ManifestMismatch, match="'layer.0.bias'.*float16 inside a float32 bucket"):
        validate_against(bad, expected_layout(_named()))


def test_duplicate_tensor_and_bad_header(manifest):
    dup = TensorSpec("embed.weight", "float32", (8,), 512, 32)
    bucket = manifest.buckets[1]
    bad = _edit_bucket(manifest, 1, tensors=bucket.tensors + (dup,), nbytes=544)
    with pytest.raises(ManifestMismatch, match="'embed.weight'.*more than once"):
        validate_against(bad, expected_layout(_named()))
    with pytest.raises(ManifestMismatch, match="fingerprint_algo 'crc'"):
        validate_against(dataclasses.replace(manifest, fingerprint_algo="crc"), {})
    with pytest.raises(ManifestMismatch, match="bucket at position 1 has index 5"):
        validate_against(_edit_bucket(manifest, 1, index=5), expected_layout(_named()))
    with pytest.raises(ManifestMismatch, match="bucket 0.*float13"):
        validate_against(_edit_bucket(manifest, 0, dtype="float13"), expected_layout(_named()))


def test_empty_model_and_manifest_agree():
    empty = Manifest(0, "gpu", (), "fast")
    validate_against(empty, {})
    assert manifest_from_proto(manifest_to_proto(empty)) == empty
    assert BucketSpec(0, "float32", (), 0).fingerprint == ""
