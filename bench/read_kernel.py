"""A read-only Triton kernel for `bench/rollout.py`'s streaming read bandwidth (imported only
on a GPU): each program sums 16 blocks of 4096 elements, loaded past L1, into one float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096
PER_PROGRAM = 16


@triton.jit
def _read_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * PER_PROGRAM
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(PER_PROGRAM):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def read_sum(x: torch.Tensor):
    """A function that reads all of bf16 `x` once (its per-program sums checked on the first call)."""
    programs = triton.cdiv(x.numel(), BLOCK * PER_PROGRAM)
    out = torch.empty(programs, dtype=torch.float32, device=x.device)

    def run():
        _read_sum[(programs,)](x, out, x.numel(), BLOCK=BLOCK, PER_PROGRAM=PER_PROGRAM, num_warps=8)

    run()
    want = x[: min(x.numel(), BLOCK * PER_PROGRAM)].float().sum()
    if not torch.allclose(out[0], want):
        raise RuntimeError(f"read kernel: first program summed {float(out[0])}, expected {float(want)}")
    return run
