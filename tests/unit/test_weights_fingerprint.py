"""Fingerprints: definition, stability, and sensitivity to flipped bytes and swapped tensors."""

import hashlib
import importlib
import re
import struct

import pytest
import torch

from services.weights.buckets import pack_bucket, plan_buckets
from services.weights.fingerprint import IncrementalFingerprint, copy_and_fingerprint, fingerprint, fingerprint_algo

# The package re-exports the function `fingerprint`, which shadows the submodule attribute.
fp_module = importlib.import_module("services.weights.fingerprint")
_MASK64 = (1 << 64) - 1


def _reference_fast(data: bytes) -> str:
    """The "fast" definition in exact Python integers."""
    row_words = fp_module._ROW_WORDS
    row_bytes = 4 * row_words
    padded = data + bytes(-len(data) % row_bytes)
    words = struct.unpack(f"<{len(padded) // 4}i", padded)
    s0 = sum(words)
    s1 = 0
    for k in range(len(words) // row_words):
        row = words[k * row_words : (k + 1) * row_words]
        row_sum = sum((fp_module._C1 + fp_module._S1 * j) * x for j, x in enumerate(row))
        s1 += (fp_module._C2 + fp_module._S2 * k) * row_sum
    return f"fast:{len(data):016x}{s0 & _MASK64:016x}{s1 & _MASK64:016x}"


def _random_bytes(num_bytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("num_bytes", [0, 1, 3, 4, 4096, 3 * 4096 + 13])
def test_fast_matches_exact_integer_definition(num_bytes):
    flat = _random_bytes(num_bytes)
    assert fingerprint(flat) == _reference_fast(flat.numpy().tobytes())


def test_fast_is_pinned_and_stable():
    flat = torch.frombuffer(bytearray(bytes(range(256)) * 40 + b"xyz"), dtype=torch.uint8)
    value = fingerprint(flat)
    assert re.fullmatch(r"fast:[0-9a-f]{48}", value)
    # A change here changes every fingerprint on the wire: trainers and engines must agree.
    assert value == "fast:00000000000028030000000f057565786aebb255cd3b9328"
    assert fingerprint(flat.clone()) == value == _reference_fast(flat.numpy().tobytes())
    assert fingerprint_algo(value) == "fast"


def test_fast_does_not_depend_on_step_size_or_alignment(monkeypatch):
    flat = _random_bytes(10 * 4096 + 6, seed=1)
    expected = fingerprint(flat)
    for rows in (1, 3, 1000):
        monkeypatch.setattr(fp_module, "_CPU_ROWS_PER_STEP", rows)
        assert fingerprint(flat) == expected
    shifted = torch.empty(flat.numel() + 1, dtype=torch.uint8)
    shifted[1:] = flat
    assert fingerprint(shifted[1:]) == expected  # misaligned start: same bytes, same answer


def test_fast_detects_every_single_flipped_byte():
    flat = _random_bytes(2 * 4096 + 5, seed=2)
    base = fingerprint(flat)
    g = torch.Generator().manual_seed(3)
    seen = {base}
    for pos in range(flat.numel()):
        bit = int(torch.randint(0, 8, (1,), generator=g))
        flat[pos] ^= 1 << bit
        seen.add(fingerprint(flat))
        flat[pos] ^= 1 << bit
    assert len(seen) == flat.numel() + 1
    assert fingerprint(flat) == base


def test_fast_detects_swapped_tensors_and_words():
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    spec = plan_buckets([("a", a), ("b", b)])[0]
    packed = pack_bucket(spec, {"a": a, "b": b})
    swapped = pack_bucket(spec, {"a": b, "b": a})
    assert fingerprint(packed) != fingerprint(swapped)
    words = packed.view(torch.int32)
    for i, j in [(0, 1), (5, 5 + 1024), (7, 4000), (0, words.numel() - 1)]:
        moved = words.clone()
        moved[i], moved[j] = words[j], words[i]
        assert fingerprint(moved.view(torch.uint8)) != fingerprint(packed), (i, j)


def test_fast_counts_trailing_zero_bytes():
    flat = _random_bytes(100)
    longer = torch.cat([flat, torch.zeros(1, dtype=torch.uint8)])
    assert fingerprint(flat) != fingerprint(longer)


def test_sha256_is_exact_and_unknown_algo_is_named():
    flat = _random_bytes(1000)
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    assert fingerprint(flat, "sha256") == "sha256:" + digest
    with pytest.raises(ValueError, match="md5"):
        fingerprint(flat, "md5")
    with pytest.raises(ValueError, match="uint8"):
        fingerprint(flat.float())
    with pytest.raises(ValueError, match="malformed"):
        fingerprint_algo("nohex")


def _reference_xxh3(data: bytes) -> str:
    """The documented definition, written out independently of the module."""
    import struct

    import xxhash

    piece = 16 << 20
    digests = [xxhash.xxh3_64_intdigest(data[i : i + piece]) for i in range(0, max(len(data), 1), piece)]
    return "xxh3:" + xxhash.xxh3_64_hexdigest(struct.pack(f"<{1 + len(digests)}Q", len(data), *digests))


@pytest.mark.parametrize("nbytes", [0, 100_003, (16 << 20) * 2 + 5])
def test_xxh3_follows_its_definition_and_catches_a_flipped_byte(nbytes):
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    value = fingerprint(flat, "xxh3")
    assert value == _reference_xxh3(flat.numpy().tobytes())
    if nbytes:
        flat[nbytes - 3] ^= 1  # in the last piece
        assert fingerprint(flat, "xxh3") != value
    assert fingerprint_algo(value) == "xxh3"


def test_copy_and_fingerprint_copies_exactly_and_hashes_the_copy():
    src = torch.randint(0, 256, ((16 << 20) + 300_001,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    value = copy_and_fingerprint(dst, src)
    assert torch.equal(dst, src)
    assert value == fingerprint(src, "xxh3")
    with pytest.raises(ValueError, match="one size"):
        copy_and_fingerprint(dst[:10], src)


def test_incremental_fingerprint_of_a_buffer_filled_in_parts_equals_the_whole():
    data = torch.randint(0, 256, ((16 << 20) * 3 + 12_345,), dtype=torch.uint8)
    buffer = torch.zeros_like(data)
    hasher = IncrementalFingerprint(buffer)
    for start in range(0, data.numel(), 5_000_000):  # parts that do not line up with pieces
        stop = min(start + 5_000_000, data.numel())
        buffer[start:stop] = data[start:stop]
        hasher.filled(stop)
    assert hasher.result() == fingerprint(data, "xxh3")

