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
    with pytest.raises(ValueError, match="of its size"):
        fast_cuda.copy_and_fingerprint([(targets[0], sources[1])])


def test_uploading_from_page_locked_host_memory_copies_and_fingerprints_in_one_pass():
    """The SMs read page-locked host buckets (cudaHostAlloc, and shared-memory segments locked
    with cudaHostRegister, as an engine maps a sleeping trainer's host copy) over PCIe."""
    from services.weights import shm

    gen = torch.Generator().manual_seed(5)
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).pin_memory() for n in SIZES]
    segments = shm.SharedBuffers([n for n in SIZES[-3:]], pinned=True, prefix="rlfleet-test")
    try:
        for seg, src in zip(segments.buffers, sources[-3:]):
            seg.copy_(src)
        sources += segments.buffers
        assert all(fast_cuda.mapped(s) for s in sources)
        targets = [torch.zeros(s.numel(), dtype=torch.uint8, device="cuda") for s in sources]
        prints = fast_cuda.copy_and_fingerprint(zip(targets, sources))
        assert all(torch.equal(t.cpu(), s) for t, s in zip(targets, sources))
        assert prints == ["fast:" + _fast(s) for s in sources]
        sources[-1][5] ^= 1  # the host bytes change: the next upload sees it
        assert fast_cuda.copy_and_fingerprint([(targets[-1], sources[-1])]) != [prints[-1]]
        assert torch.equal(targets[-1].cpu(), sources[-1])
    finally:
        segments.close()
    pageable = torch.zeros(4096, dtype=torch.uint8)  # the GPU cannot read it where it is
    assert not fast_cuda.mapped(pageable)
    with pytest.raises(ValueError, match="page-locked"):
        fast_cuda.copy_and_fingerprint([(torch.zeros(4096, dtype=torch.uint8, device="cuda"), pageable)])


def test_upload_and_fingerprint_gives_the_same_buffers_and_fingerprints_either_way():
    """The one-pass kernel upload (page-locked sources) and the copy-engine upload (a pageable
    source makes it fall back) agree with each other and with the definition."""
    from services.weights.staging import upload_and_fingerprint

    gen = torch.Generator().manual_seed(9)
    host = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in SIZES]
    device = torch.device("cuda")
    by_kernel, kernel_prints = upload_and_fingerprint([h.pin_memory() for h in host], device, "fast")
    by_engines, engine_prints = upload_and_fingerprint(host, device, "fast")
    assert kernel_prints == engine_prints == ["fast:" + _fast(h) for h in host]
    assert all(torch.equal(a, b) and torch.equal(a.cpu(), h) for a, b, h in zip(by_kernel, by_engines, host))
