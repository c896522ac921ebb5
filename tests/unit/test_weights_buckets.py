"""Bucket planning, packing and unpacking: layout rules and bit-exact round trips."""

import pytest
import torch

from services.weights.buckets import (
    ALIGN_BYTES,
    dtype_name,
    pack_bucket,
    parse_dtype,
    plan_buckets,
    unpack_bucket,
)


def _mixed_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(33, 7, generator=g).to(torch.bfloat16)),
        ("norm.weight", torch.randn(7, generator=g)),  # float32
        ("layer.0.q.weight", torch.randn(7, 7, generator=g).to(torch.float16)),
        ("layer.0.k.weight", torch.randn(5, 7, generator=g).to(torch.bfloat16)),
        ("layer.0.scale", torch.randn((), generator=g)),  # 0-d float32
        ("layer.0.empty", torch.empty(0, 3, dtype=torch.float16)),
        # non-contiguous
        ("layer.0.t.weight", torch.randn(9, 4, generator=g).to(torch.bfloat16).t()),
        ("positions", torch.arange(11)),  # int64 buffer
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_dtype_names_round_trip_and_unknown_is_named():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        assert parse_dtype(dtype_name(dtype)) is dtype
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="float13"):
        parse_dtype("float13")
    with pytest.raises(ValueError, match="complex64"):
        dtype_name(torch.complex64)


def test_plan_groups_by_dtype_keeping_model_order_and_aligns_offsets():
    named = _mixed_weights()
    buckets = plan_buckets(named, bucket_bytes=1 << 20)
    assert [b.dtype for b in buckets] == ["bfloat16", "float32", "float16", "int64"]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    bf16_names = [t.name for t in buckets[0].tensors]
    assert bf16_names == ["embed.weight", "layer.0.k.weight", "layer.0.t.weight"]
    for bucket in buckets:
        assert bucket.nbytes == bucket.tensors[-1].end
        for prev, cur in zip(bucket.tensors, bucket.tensors[1:]):
            assert cur.offset % ALIGN_BYTES == 0 and cur.offset >= prev.end
    shapes = {t.name: (t.shape, t.nbytes) for b in buckets for t in b.tensors}
    assert shapes["layer.0.t.weight"] == ((4, 9), 72)
    assert shapes["layer.0.scale"] == ((), 4)


def test_plan_fills_buckets_and_gives_oversized_tensor_its_own_bucket():
    named = [(f"w{i}", torch.zeros(100)) for i in range(50)]  # 400 B each, 512 B slots
    named.insert(20, ("big", torch.zeros(3000)))  # 12000 B > bucket
    buckets = plan_buckets(named, bucket_bytes=4096)
    big = [b for b in buckets if any(t.name == "big" for t in b.tensors)]
    assert len(big) == 1 and len(big[0].tensors) == 1 and big[0].nbytes == 12000
    # 8 slots fit (7 * 512 + 400 = 3984 <= 4096); the big tensor closes the bucket before it.
    assert [len(b.tensors) for b in buckets] == [8, 8, 4, 1, 8, 8, 8, 6]
    assert all(b.nbytes <= 4096 for b in buckets if b is not big[0])
    order = [t.name for b in buckets for t in b.tensors]
    assert order == [name for name, _ in named]  # model order survives the split
    assert sum(len(b.tensors) for b in buckets) == 51


def test_plan_rejects_duplicate_names_and_bad_bucket_size():
    with pytest.raises(ValueError, match="'a'"):
        plan_buckets([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", torch.zeros(1))], bucket_bytes=0)


@pytest.mark.parametrize("bucket_bytes", [256, 1 << 20])
def test_pack_unpack_round_trip_is_bit_identical(bucket_bytes):
    named = _mixed_weights()
    by_name = dict(named)
    received = {}
    for spec in plan_buckets(named, bucket_bytes):
        flat = pack_bucket(spec, by_name)
        assert flat.dtype == torch.uint8 and flat.shape == (spec.nbytes,)
        received.update(unpack_bucket(spec, flat.clone()))
    assert received.keys() == by_name.keys()
    for name, tensor in named:
        got = received[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(_bits(got), _bits(tensor)), name


def test_unpack_returns_views_into_the_flat_buffer():
    named = _mixed_weights()
    spec = plan_buckets(named)[0]
    flat = pack_bucket(spec, dict(named))
    views = unpack_bucket(spec, flat)
    embed = views["embed.weight"]
    assert embed.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    flat[: spec.tensors[0].nbytes].zero_()
    assert torch.count_nonzero(embed) == 0


def test_pack_reuses_out_and_zeroes_gaps():
    named = _mixed_weights()
    spec = plan_buckets(named)[0]
    fresh = pack_bucket(spec, dict(named))
    out = torch.full((spec.nbytes + 100,), 0xFF, dtype=torch.uint8)
    packed = pack_bucket(spec, dict(named), out=out)
    assert packed.data_ptr() == out.data_ptr() and packed.numel() == spec.nbytes
    assert torch.equal(packed, fresh)  # stale 0xFF bytes in the gaps were cleared


def test_pack_and_unpack_name_the_problem():
    named = _mixed_weights()
    spec = plan_buckets(named)[0]
    by_name = dict(named)
    by_name["layer.0.k.weight"] = torch.zeros(6, 7, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layer.0.k.weight"):
        pack_bucket(spec, by_name)
    del by_name["layer.0.k.weight"]
    with pytest.raises(ValueError, match="layer.0.k.weight.*missing"):
        pack_bucket(spec, by_name)
    with pytest.raises(ValueError, match="needs"):
        unpack_bucket(spec, torch.zeros(spec.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        unpack_bucket(spec, torch.zeros(spec.nbytes, dtype=torch.float32))


def test_host_bytes_keeps_a_temporary_tensor_alive():
    import gc

    from services.weights.buckets import host_bytes

    view = host_bytes(torch.arange(4096, dtype=torch.int64).view(torch.uint8).clone())
    gc.collect()
    _ = [torch.full((4096 * 8,), 255, dtype=torch.uint8) for _ in range(64)]  # would reuse freed memory
    assert bytes(view[:16]) == torch.tensor([0, 1], dtype=torch.int64).view(torch.uint8).numpy().tobytes()
