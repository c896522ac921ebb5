"""A screening experiment (2026-12-03): the decode step's products at 64 and 256 rows as a plain
Triton tile kernel (`tl.dot` on BLOCK_M x BLOCK_N output tiles, k optionally split in a few
shares whose float32 partials a second kernel adds in share order), against `F.linear`
(cuBLAS), over a grid of tile shapes.

Why: at 256 rows cuBLAS runs the attention's q/k/v and o products (1-2 MB of weight) in ~5 us
each, on 18 or 14 tiles of 128 x 128, so 14-18 SMs do all of a product's multiplications and
loads; in the step they cost 122 and 134 us (bench/results/ablate-experiment-*). More, smaller
tiles spread that over the GPU. The MLP's products are there for comparison.

Each product is timed as a CUDA graph of 24 calls, each on its own copy of the weight (so the
weights come from HBM, as in a step, not from L2), the median of 5 replays; the streaming read
bandwidth of the same run gives the weights' time at the bandwidth. Every tile kernel's output
is checked against F.linear's.

    python bench/experiments/tile_linear.py [rows, comma-separated]   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.rollout.builtin import cublaslt  # noqa: E402

SHAPES = {  # name: (n_out, k, bias)
    "0.5b qkv": (1152, 896, True), "0.5b o": (896, 896, False), "0.5b gate_up": (9728, 896, False),
    "0.5b down": (896, 4864, False),
    "1.5b qkv": (2048, 1536, True), "1.5b o": (1536, 1536, False), "1.5b gate_up": (17920, 1536, False),
    "1.5b down": (1536, 8960, False),
}
COPIES = 24


@triton.jit
def _tile_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, rows, n, k, k_share, stride_x, stride_out,
                        HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [rows, n] = x [rows, k] @ w [n, k]^T (+ bias); one program per (BLOCK_M x BLOCK_N
    tile, share of k), the tiles of one weight block adjacent in launch order (they run
    together, so the block is read from memory once). With PARTIAL the program writes its
    float32 sum to out [shares, rows, n] instead. k_share is a multiple of BLOCK_K."""
    pid = tl.program_id(0)
    share = tl.program_id(1)
    m_tiles = tl.cdiv(rows, BLOCK_M)
    m = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < rows
    n_ok = cols < n
    first = share * k_share
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None] * stride_x + (first + kk)[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * k + (first + kk)[None, :]
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, k_share, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + share * rows * n + m[:, None] * n + cols[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_shares_kernel(part_ptr, b_ptr, out_ptr, total, n, SHARES: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr):
    """out = sum of part [SHARES, total] in share order (+ bias by column), rounded."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for share in tl.static_range(1, SHARES):
        acc += tl.load(part_ptr + share * total + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def tile_linear(x, w, bias, cfg, part=None, out=None):
    block_m, block_n, block_k, warps, stages, shares = cfg
    rows, k = x.shape
    n = w.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n), shares)
    k_share = k // shares
    if shares == 1:
        _tile_linear_kernel[grid](x, w, bias if bias is not None else w, out, rows, n, k, k_share, x.stride(0),
                                  out.stride(0), HAS_BIAS=bias is not None, PARTIAL=False, BLOCK_M=block_m,
                                  BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
                                  launch_pdl=True)
        return out
    _tile_linear_kernel[grid](x, w, w, part, rows, n, k, k_share, x.stride(0), n, HAS_BIAS=False, PARTIAL=True,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                              num_stages=stages, launch_pdl=True)
    total = rows * n
    _add_shares_kernel[(triton.cdiv(total, 1024),)](part, bias if bias is not None else w, out, total, n,
                                                     SHARES=shares, HAS_BIAS=bias is not None, BLOCK=1024,
                                                     num_warps=4, launch_pdl=True)
    return out


def configs(rows: int, n: int, k: int):
    """Tile shapes whose pipeline fits shared memory, k shares where k is long."""
    for block_m in (64, 128, 256):
        if block_m > max(64, rows):
            continue
        for block_n in (32, 64, 128, 256):
            for block_k in (64, 128):
                stages = 4 if block_k == 64 else 3
                if stages * (block_m + block_n) * block_k * 2 > 200 * 1024:
                    continue
                warps = 8 if block_m * block_n >= 128 * 128 else 4
                tiles = triton.cdiv(rows, block_m) * triton.cdiv(n, block_n)
                for shares in (1, 2, 4, 8):
                    if k % (shares * block_k) or (shares > 1 and tiles * shares > 2 * 132 + 8):
                        continue
                    yield block_m, block_n, block_k, warps, stages, shares


def graph_us(calls) -> float:
    """Microseconds a call of `calls`, back to back in a CUDA graph (the engine's timing)."""
    return cublaslt.graph_us(lambda i: calls[i](), len(calls))


def main() -> None:
    row_counts = [int(r) for r in sys.argv[1].split(",")] if len(sys.argv) > 1 else [256, 64]
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    read_us = graph_us([lambda: src.view(torch.int64).sum()])
    bandwidth = (1 << 30) / read_us / 1e6
    print(f"# read bandwidth {bandwidth:.2f} TB/s", flush=True)
    src = None  # the 1 GiB buffer freed
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k, has_bias) in SHAPES.items():
        weights = [(torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(COPIES)]
        bias = (torch.randn(n, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) if has_bias else None
        for rows in row_counts:
            x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
            out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
            want = F.linear(x, weights[0], bias).float()
            cublas = graph_us([lambda w=w: F.linear(x, w, bias) for w in weights])
            weight_us = n * k * 2 / bandwidth / 1e6
            results = []
            for cfg in configs(rows, n, k):
                part = torch.empty(cfg[5], rows, n, dtype=torch.float32, device="cuda") if cfg[5] > 1 else None
                try:
                    got = tile_linear(x, weights[0], bias, cfg, part).float()
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    us = graph_us([lambda w=w: tile_linear(x, w, bias, cfg, part, out) for w in weights])
                except Exception as exc:  # a config that does not compile or fit: say so, go on
                    print(f"# {name} b{rows} {cfg} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                    continue
                results.append((us, cfg, err))
            results.sort()
            best = "  ".join(f"{us:5.1f} {cfg} err {err:.1e}" for us, cfg, err in results[:4])
            print(f"{name:13s} b{rows:<4d} at bandwidth {weight_us:5.1f} us  cublas {cublas:5.1f}  "
                  f"best {best}", flush=True)
            print(f"#   all {[(round(us, 1), cfg) for us, cfg, _ in results]}", flush=True)
        del weights


if __name__ == "__main__":
    main()
