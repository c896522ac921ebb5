"""Triton kernels for the decode step's matrix products that cuBLAS runs short of the bandwidth:
the attention's q/k/v and o (and a small batch's MLP down product with its SiLU read in). Both
ask L2 for their weight lines before they wait for the kernel before them, so that with
programmatic dependent launch the weight bytes arrive while that kernel still runs: the
small-batch kernel (`_skinny_linear_kernel`, up to 16 rows) and plain tiles for more rows
(`_tile_linear_kernel`). Which products take them: `TritonOps.linear`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from services.rollout.builtin.pointwise_kernels import _silu_times

# Rows of `_skinny_linear_kernel`'s tile: 16 (the matrix unit's narrowest side) for a batch of
# up to 16, the batch's power of two up to 64 past that, in as many row tiles as it takes.
SKINNY_BLOCK_M = 16
SKINNY_MAX_BLOCK_M = 64


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs`, kept there ahead of other lines; no register waits."""
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _finish_linear(acc, b_ptr, out_ptr, cols, n_ok, m, stride_out, out_mask, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (columns by rows) plus bias, rounded, stored as out [rows, n]."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + m[None, :] * stride_out + cols[:, None], acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _load_xt(x_ptr, up_offset, m, m_ok, kk, k_ok, stride_x, SILU: tl.constexpr):
    """x transposed, [BLOCK_K, BLOCK_M]: the rows' inputs at columns kk; with SILU, silu(gate) * up."""
    x_offs = m[None, :] * stride_x + kk[:, None]
    x_mask = m_ok[None, :] & k_ok[:, None]
    if SILU:
        gate = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
        return _silu_times(gate, tl.load(x_ptr + up_offset + x_offs, mask=x_mask, other=0.0))
    else:
        return tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, rows, n, k, k_split, up_offset,
                          stride_x, stride_out, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SPLITS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          LINES: tl.constexpr):
    """out [rows, n] = x [rows, k] @ w [n, k]^T (+ bias) for a decode step's rows: one program
    per (BLOCK_N output columns, share of k, BLOCK_M rows), the weight's rows on the matrix
    unit's long side.

    Before `gdc_wait` the program asks L2 for its whole weight tile: with programmatic dependent
    launch it starts while the kernel before it (whose output is x) still runs, so the weight
    bytes come in from memory during that kernel instead of after it. (Loading the tile into the
    program instead measured the same for q/k/v and o, and worse for the MLP products, on an
    H200; docs/design/engine-tuning.md.) With SILU, x is silu(gate) * up of the gated MLP (gate
    at x, up `up_offset` columns on), rounded as `silu_mul` rounds. With SPLITS > 1 each program
    writes its float32 partial and the last of a column block's programs to finish (an atomic
    count) adds them in split order: one launch, and the same sum whatever order the programs
    finish in."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    row_tile = tl.program_id(2)
    m_pad = tl.num_programs(2) * BLOCK_M  # rows of the partials
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < n
    k_start = split * k_split
    k_end = tl.minimum(k_start + k_split, k)
    rows_w = w_ptr + cols.to(tl.int64) * k  # [BLOCK_N] row starts
    line = k_start + tl.arange(0, LINES) * 64  # a 128-byte line holds 64 bf16
    _prefetch_l2(tl.where(n_ok[:, None] & (line < k_end)[None, :], rows_w[:, None] + line[None, :], w_ptr))
    tl.extra.cuda.gdc_wait()  # the kernel before this one (x's writer) has finished
    tl.extra.cuda.gdc_launch_dependents()
    m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < rows
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for first in range(k_start, k_end, BLOCK_K):
        kk = first + tl.arange(0, BLOCK_K)
        k_ok = kk < k_end
        w = tl.load(rows_w[:, None] + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(w, _load_xt(x_ptr, up_offset, m, m_ok, kk, k_ok, stride_x, SILU), acc)  # [BLOCK_N, BLOCK_M]
    out_mask = n_ok[:, None] & m_ok[None, :]
    if SPLITS == 1:
        _finish_linear(acc, b_ptr, out_ptr, cols, n_ok, m, stride_out, out_mask, HAS_BIAS)
    else:
        part = part_ptr + m[None, :] * n + cols[:, None]  # partials [SPLITS, m_pad, n]
        tl.store(part + split * m_pad * n, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        counter = count_ptr + pid * tl.num_programs(2) + row_tile
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            tl.debug_barrier()
            total = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            for other in tl.static_range(SPLITS):
                total += tl.load(part + other * m_pad * n, mask=out_mask, other=0.0, cache_modifier=".cg")
            _finish_linear(total, b_ptr, out_ptr, cols, n_ok, m, stride_out, out_mask, HAS_BIAS)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _tile_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, rows, n, k, stride_x, stride_out, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LINES: tl.constexpr):
    """out [rows, n] = x [rows, k] @ w [n, k]^T (+ bias) in BLOCK_M x BLOCK_N output tiles, one
    program a tile (k a multiple of BLOCK_K), the tiles of one weight block adjacent in launch
    order: they run together, so the block comes from memory once.

    Launched with PDL, the program starts while the kernel before it (x's writer) still runs,
    and asks L2 for its weight lines (a block's programs take every m_tiles-th 128-byte line
    each) before it waits for that kernel."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(rows, BLOCK_M)
    m = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < rows
    n_ok = cols < n
    rows_w = w_ptr + cols.to(tl.int64)[:, None] * k
    line = tl.arange(0, LINES)
    line_ok = (line % m_tiles == pid % m_tiles) & (line * 64 < k)
    _prefetch_l2(tl.where(n_ok[:, None] & line_ok[None, :], rows_w + line[None, :] * 64, w_ptr))
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None] * stride_x + kk[None, :]
    w_ptrs = rows_w + kk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, k, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])
