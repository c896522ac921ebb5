"""The one-pass Triton "fast" fingerprint gives the tensor-op definition's result bit for bit,
on sizes with partial rows, and its copying form copies exactly."""

from __future__ import annotations

import pytest
import torch

from services.weights import fast_cuda
from services.weights.fingerprint import _fast, fingerprint, fingerprints

pytestmark = pytest.mark.gpu

SIZES = [1, 3, 4, 4095, 4096, 4100, 3 * 4096 + 8, (1 << 20) + 12, (64 << 20) + 3 * 4096 + 8]


def _random(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)


@pytest.mark.parametrize("n", SIZES)
def test_triton_fast_equals_the_definition(n):
    flat = _random(n, n)
    assert fast_cuda.available(flat)
    assert fast_cuda.fingerprints([flat]) == ["fast:" + _fast(flat)]


def test_every_caller_gets_the_same_fingerprint_whichever_implementation_runs():
    flats = [_random(n, i) for i, n in enumerate(SIZES)]
    want = ["fast:" + _fast(f) for f in flats]
    assert fingerprints(flats) == want
    assert [fingerprint(f, "fast") for f in flats] == want
    assert [fingerprint(f.cpu(), "fast") for f in flats] == want  # the host computes the same
    misaligned = flats[-1][1:]  # not 16-byte aligned: the tensor-op path
    assert not fast_cuda.available(misaligned)
    assert fingerprint(misaligned, "fast") == "fast:" + _fast(misaligned)


def test_copy_and_fingerprint_copies_exactly_and_fingerprints_the_copy():
    sources = [_random(n, 100 + i) for i, n in enumerate(SIZES)]
    targets = [torch.zeros_like(s) for s in sources]
    prints = fast_cuda.copy_and_fingerprint((t, s) for t, s in zip(targets, sources))  # a generator too
    assert all(torch.equal(t, s) for t, s in zip(targets, sources))
    assert prints == ["fast:" + _fast(s) for s in sources]
    sources[3][7] ^= 1  # one flipped bit
    assert fast_cuda.copy_and_fingerprint([(targets[3], sources[3])]) != [prints[3]]
    with pytest.raises(ValueError, match="one size"):
        fast_cuda.copy_and_fingerprint([(targets[0], sources[1])])
