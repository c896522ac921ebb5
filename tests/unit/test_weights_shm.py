"""The shared-memory plane's ownership rules: an engine serves the trainer's segments, so the
trainer must never rewrite a set an engine still serves, and an engine must never take a set
the trainer is writing. Locks are flocks, which conflict between two descriptors even in one
process, so both sides can be exercised here; tests/integration/test_planes.py runs them as
separate processes."""

from __future__ import annotations

import pytest
import torch

from services.weights.buckets import BucketSpec, Manifest, TensorSpec
from services.weights.errors import WeightSyncError
from services.weights.shm import SHM_DIR, ShmReader, ShmWriter, available

pytestmark = pytest.mark.skipif(not available(), reason="needs a writable /dev/shm")

SIZES = [4096, 1000]


def _manifest(version: int) -> Manifest:
    buckets = tuple(
        BucketSpec(index=i, dtype="uint8", tensors=(TensorSpec(f"t{i}", "uint8", (n,), 0, n),), nbytes=n)
        for i, n in enumerate(SIZES)
    )
    return Manifest(version=version, source="gpu", buckets=buckets, fingerprint_algo="xxh3")


def _write(writer: ShmWriter, value: int) -> list[str]:
    for view in writer.begin(SIZES):
        view.fill_(value)
    return writer.end()


def test_a_served_set_is_never_rewritten_and_a_free_one_is_reused():
    writer, reader = ShmWriter("rlfleet-test"), ShmReader()
    try:
        first = _write(writer, 1)
        served = reader.open(first, _manifest(1))
        reader.adopted()
        second = _write(writer, 2)
        assert set(second).isdisjoint(first)
        assert all(bool((v == 1).all()) for v in served)

        # The engine's update to the second set fails: it keeps serving the first one.
        reader.open(second, _manifest(2))
        reader.abandon()
        fresh_before = writer.fresh_sets
        third = _write(writer, 3)
        assert set(third).isdisjoint(first) and writer.fresh_sets == fresh_before + 1
        assert all(bool((v == 1).all()) for v in served)  # still version 1's bytes

        # Once the engine moves on, the set it let go of is rewritten in place.
        reader.open(third, _manifest(3))
        reader.adopted()
        fourth = _write(writer, 4)
        assert fourth == second and writer.fresh_sets == fresh_before + 1
    finally:
        reader.close()
        writer.close()
    assert not any((SHM_DIR / n).exists() for n in first + second + third)


def test_an_engine_cannot_take_a_set_while_it_is_being_written():
    writer, reader = ShmWriter("rlfleet-test"), ShmReader()
    try:
        names = _write(writer, 1)
        reader.open(names, _manifest(1))
        reader.abandon()
        writer.begin(SIZES)  # the set written next: a different one
        other = writer._sets[writer._last].names  # noqa: SLF001 (the set now locked for writing)
        with pytest.raises(WeightSyncError, match="being rewritten"):
            reader.open(other, _manifest(2))
        writer.end()
    finally:
        reader.close()
        writer.close()


def test_bad_segment_lists_are_named():
    writer, reader = ShmWriter("rlfleet-test"), ShmReader()
    try:
        names = _write(writer, 1)
        with pytest.raises(ValueError, match="1 segments for 2 buckets"):
            reader.open(names[:1], _manifest(1))
        with pytest.raises(ValueError, match="not a segment name"):
            reader.open(["../etc/passwd", names[1]], _manifest(1))
        with pytest.raises(WeightSyncError, match="does not exist"):
            reader.open(["rlfleet-test-missing", names[1]], _manifest(1))
        with pytest.raises(WeightSyncError, match="holds 1000 bytes, bucket 0 needs 4096"):
            reader.open([names[1], names[1]], _manifest(1))
    finally:
        reader.close()
        writer.close()


def test_views_stay_readable_after_the_trainer_unlinks():
    writer, reader = ShmWriter("rlfleet-test"), ShmReader()
    names = _write(writer, 7)
    views = reader.open(names, _manifest(1))
    reader.adopted()
    writer.close()
    assert not (SHM_DIR / names[0]).exists()
    assert int(views[0].sum()) == 7 * SIZES[0]
    reader.close()
    assert torch.equal(views[1], torch.full((SIZES[1],), 7, dtype=torch.uint8))


def test_shared_host_buffers_are_mapped_by_name_and_unlinked_on_close():
    from services.weights.shm import SharedBuffers

    shared = SharedBuffers(SIZES, pinned=False, prefix="rlfleet-test-host")
    reader = ShmReader()
    try:
        assert all((SHM_DIR / n).exists() for n in shared.names)
        assert all(bool((b == 0).all()) for b in shared.buffers)  # new pages read as zero
        shared.buffers[0].fill_(9)
        views = reader.open(shared.names, _manifest(1))
        reader.copied()  # copied out, not adopted: no lock stays behind
        assert int(views[0].sum()) == 9 * SIZES[0]
    finally:
        reader.close()
        shared.close()
    assert not any((SHM_DIR / n).exists() for n in shared.names)
