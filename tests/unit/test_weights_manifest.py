"""Manifest proto round trip and `validate_against`, one test per kind of mismatch."""

import dataclasses

import pytest
import torch

from services.api import weights_pb2
from services.weights.buckets import BucketSpec, Manifest, TensorSpec, pack_bucket, plan_buckets
from services.weights.errors import ManifestMismatch
from services.weights.manifest import (
    ManifestEncoder,
    ManifestReader,
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


# ---- layouts checked once -----------------------------------------------------------------------
def _next_version(manifest: Manifest, version: int, seed: int) -> Manifest:
    """The same layout with new bytes: what a trainer sends after a train step."""
    g = torch.Generator().manual_seed(seed)
    flats = [torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8, generator=g) for b in manifest.buckets]
    return make_manifest(version, manifest.source, [dataclasses.replace(b, fingerprint="") for b in manifest.buckets],
                         flats, manifest.fingerprint_algo)


def test_reader_takes_version_and_fingerprints_of_each_message_for_a_layout_it_checked(manifest):
    reader = ManifestReader(expected_layout(_named()))
    assert reader.read(manifest_to_proto(manifest)) == manifest
    later = _next_version(manifest, 8, seed=1)
    assert [b.fingerprint for b in later.buckets] != [b.fingerprint for b in manifest.buckets]
    assert reader.read(manifest_to_proto(later)) == later


def test_reader_still_rejects_a_changed_layout_and_a_foreign_fingerprint(manifest):
    reader = ManifestReader(expected_layout(_named()))
    reader.read(manifest_to_proto(manifest))
    reshaped = _edit_tensor(manifest, "norm.weight", shape=(4, 2))
    with pytest.raises(ManifestMismatch, match="'norm.weight'.*shape"):
        reader.read(manifest_to_proto(reshaped))
    foreign = _edit_bucket(manifest, 0, fingerprint="sha256:00")
    with pytest.raises(ManifestMismatch, match="bucket 0 fingerprint 'sha256:00' is not a 'fast'"):
        reader.read(manifest_to_proto(foreign))
    assert reader.read(manifest_to_proto(manifest)) == manifest  # and the good layout still reads


def test_encoder_writes_what_manifest_to_proto_writes_across_versions_and_layouts(manifest):
    encoder = ManifestEncoder()
    later = _next_version(manifest, 8, seed=1)
    assert encoder.encode(manifest) == manifest_to_proto(manifest)
    assert encoder.encode(later) == manifest_to_proto(later)  # from the template of the same layout
    other = make_manifest(9, "gpu", plan_buckets(_named()[:2]), [pack_bucket(b, dict(_named()))
                                                                  for b in plan_buckets(_named()[:2])])
    assert encoder.encode(other) == manifest_to_proto(other)
