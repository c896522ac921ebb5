"""Experiment (2026-12-03, session 27): a prefill's gate/up product with its SiLU in the epilogue,
as one Triton kernel, against cuBLAS's product and the engine's SiLU kernel.

Why: at 256 prompts of 64 tokens the SiLU reads the [16384, 2I] product back from memory and
writes [16384, I]: 111 us a layer at 0.5B (2.7 ms of a 23.6 ms prefill), ~210 at 1.5B (5.9 ms
of 74), 1-1.5% of a 128-token call at batch 256. A kernel that multiplies x by a block of gate
rows and the same block of up rows (two accumulators) can apply silu(gate) * up to its tile and
write only that. It pays if its product is within the SiLU's time of cuBLAS's.

    python bench/experiments/prefill_swiglu.py   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.rollout.builtin.pointwise_kernels import _silu_times  # noqa: E402


@triton.jit
def _tile(pid, M, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The (row block, column block) of program `pid`, GROUP_M row blocks at a time (weight
    blocks shared through L2)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(I, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _gate_up_silu_kernel(x_ptr, w_ptr, out_ptr, M, I, K, stride_x, stride_out, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out [M, I] = silu(x w[:I]^T) * (x w[I:]^T), each product rounded to bf16 first."""
    pid_m, pid_n = _tile(tl.program_id(0), M, I, BLOCK_M, BLOCK_N, GROUP_M)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok = m < M
    n_ok = n < I
    a_ptrs = x_ptr + m.to(tl.int64)[:, None] * stride_x + kk[None, :]
    g_ptrs = w_ptr + n.to(tl.int64)[:, None] * K + kk[None, :]
    u_ptrs = g_ptrs + I.to(tl.int64) * K
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
        g = tl.load(g_ptrs, mask=n_ok[:, None], other=0.0)
        u = tl.load(u_ptrs, mask=n_ok[:, None], other=0.0)
        acc_g = tl.dot(a, tl.trans(g), acc_g)
        acc_u = tl.dot(a, tl.trans(u), acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    out = _silu_times(acc_g.to(out_ptr.dtype.element_ty), acc_u.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + m.to(tl.int64)[:, None] * stride_out + n[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gate_up_silu_tma_kernel(x_desc, g_desc, u_desc, out_desc, M, I, K, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """The same, operands and output through TMA descriptors."""
    pid_m, pid_n = _tile(tl.program_id(0), M, I, BLOCK_M, BLOCK_N, GROUP_M)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        a = x_desc.load([pid_m * BLOCK_M, k])
        g = g_desc.load([pid_n * BLOCK_N, k])
        u = u_desc.load([pid_n * BLOCK_N, k])
        acc_g = tl.dot(a, g.T, acc_g)
        acc_u = tl.dot(a, u.T, acc_u)
    out = _silu_times(acc_g.to(tl.bfloat16), acc_u.to(tl.bfloat16))
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], out)


def fused(x, w, config, tma: bool):
    bm, bn, bk, group, warps, stages = config
    rows, k = x.shape
    inter = w.shape[0] // 2
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, bm) * triton.cdiv(inter, bn),)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        _gate_up_silu_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w[:inter], [bn, bk]),
            TensorDescriptor.from_tensor(w[inter:], [bn, bk]), TensorDescriptor.from_tensor(out, [bm, bn]),
            rows, inter, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages)
    else:
        _gate_up_silu_kernel[grid](x, w, out, rows, inter, k, x.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                                   BLOCK_K=bk, GROUP_M=group, num_warps=warps, num_stages=stages)
    return out


CONFIGS = [  # BLOCK_M, BLOCK_N (gate and up columns each), BLOCK_K, GROUP_M, warps, stages
    (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 64, 64, 8, 4, 4), (128, 64, 64, 8, 8, 4),
    (64, 128, 64, 8, 4, 4), (128, 128, 32, 8, 8, 5), (256, 64, 64, 8, 8, 3),
]


def main() -> None:
    from services.rollout.builtin.kernels import TritonOps

    ops = TritonOps()
    for shape, hidden, inter in (("0.5b", 896, 4864), ("1.5b", 1536, 8960)):
        rows = 16384
        torch.manual_seed(0)
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(2 * inter, hidden, dtype=torch.bfloat16, device="cuda") * hidden**-0.5
        flops = 2 * rows * hidden * 2 * inter

        def reference():
            gate, up = F.linear(x, w).chunk(2, dim=-1)
            return ops.silu_mul(gate, up)

        want = reference()
        product_ms = do_bench_cudagraph(lambda: F.linear(x, w))
        both_ms = do_bench_cudagraph(reference)
        print(f"{shape} {rows}x{2 * inter}x{hidden}: cuBLAS product {product_ms * 1e3:.1f} us "
              f"({flops / product_ms / 1e9:.0f} TFLOP/s), + SiLU {both_ms * 1e3:.1f} us", flush=True)
        for tma in (False, True):
            for config in CONFIGS:
                try:
                    got = fused(x, w, config, tma)
                    ms = do_bench_cudagraph(lambda c=config, t=tma: fused(x, w, c, t))
                except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit)
                    print(f"   {'tma ' if tma else 'ptr '}{config}: failed ({type(exc).__name__}: {str(exc)[:120]})")
                    continue
                diff = (got.float() - want.float()).abs()
                print(f"   {'tma ' if tma else 'ptr '}{config}: {ms * 1e3:7.1f} us ({flops / ms / 1e9:.0f} TFLOP/s) "
                      f"against {both_ms * 1e3:.1f}; differs from cuBLAS + SiLU in {float((diff > 0).float().mean()):.2%} "
                      f"of elements, max {float(diff.max()):.3g}", flush=True)


if __name__ == "__main__":
    main()
