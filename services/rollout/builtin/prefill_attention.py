"""Causal attention of a prefill's right-padded prompts as one Triton kernel, the GPU path of
`TorchOps.prefill_attention`.

Why not SDPA: its fused kernels take one (prompt, query head, block of tokens) per program, so
for short prompts each program does one small tile and the launch is mostly start-up (cuDNN's
takes 75 us a layer for 256 prompts of 64 tokens at the 0.5B shape). Here a program takes one
(prompt, key/value head, block of BLOCK_M query rows), the rows being (token, head) pairs of that
key/value head's query group packed together: a group of 7 heads and 64 tokens is 448 rows, 7
programs, each reading the keys and values once for all its heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.rollout.builtin.attention_kernels import _attend_tile, _kv_tile


@triton.jit
def _query_rows(q_ptr, prompt, kv_head, first_row, length, stride_qg, stride_qt, GROUP: tl.constexpr,
                HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """A block of packed query rows of one (prompt, KV head): row r is token r // GROUP's query
    head kv_head * GROUP + r % GROUP. -> (q [BLOCK_M, DIM_PAD], token, head, row_ok, d, dim_ok)."""
    r = first_row + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    token = r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = token < length
    dim_ok = d < HEAD_DIM
    q_offs = prompt.to(tl.int64) * stride_qg + token[:, None] * stride_qt + head[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    return q, token, head, row_ok, d, dim_ok


@triton.jit
def _store_rows(out_ptr, acc, l, prompt, token, head, row_ok, d, dim_ok, stride_og, stride_ot,
                HEAD_DIM: tl.constexpr):
    """The rows' attention (acc / l) to out [G, P, H*D] at their (token, head)."""
    o_offs = prompt.to(tl.int64) * stride_og + token[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :]
    tl.store(out_ptr + o_offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, length, stride_qg, stride_qt, stride_kg, stride_kt,
                              stride_vg, stride_vt, stride_og, stride_ot, scale, GROUP: tl.constexpr,
                              HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One (prompt, KV head, block of packed query rows): row r is token r // GROUP's query
    head kv_head * GROUP + r % GROUP; keys up to its token attended (causal), by the decode
    kernel's online softmax (`_attend_tile`)."""
    prompt = tl.program_id(0)
    kv_head = tl.program_id(1)
    q, token, head, row_ok, d, dim_ok = _query_rows(q_ptr, prompt, kv_head, tl.program_id(2) * BLOCK_M, length,
                                                    stride_qg, stride_qt, GROUP, HEAD_DIM, DIM_PAD, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    k_base = k_ptr + prompt.to(tl.int64) * stride_kg + kv_head * HEAD_DIM
    v_base = v_ptr + prompt.to(tl.int64) * stride_vg + kv_head * HEAD_DIM
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DIM_PAD), tl.float32)
    last_token = tl.minimum(tl.max(token), length - 1)
    for first in range(0, last_token + 1, BLOCK_N):
        t = first + n
        kv_ok = (t < length)[:, None] & dim_ok[None, :]
        k = tl.load(k_base + t[:, None] * stride_kt + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_base + t[:, None] * stride_vt + d[None, :], mask=kv_ok, other=0.0)
        m, l, acc = _attend_tile(q, k, v, t[None, :] <= token[:, None], m, l, acc, scale, IEEE)  # causal
    _store_rows(out_ptr, acc, l, prompt, token, head, row_ok, d, dim_ok, stride_og, stride_ot, HEAD_DIM)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 64, block_n: int | None = None,
                      num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """q [G, P, H, D], k, v [G, P, Hkv, D] (any strides with the head dim contiguous and heads
    D apart) -> [G, P, H*D]: causal attention, every row its prompt's tokens up to its own."""
    groups, length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(3) != 1 or t.stride(2) != head_dim:
            raise ValueError(f"prefill_attention: {name}'s heads must be contiguous, got strides {t.stride()}")
    group = num_heads // num_kv_heads
    if block_n is None:
        block_n = 64 if q.element_size() == 2 else 32  # float32 tiles twice the bytes
    out = torch.empty(groups, length, num_heads * head_dim, dtype=q.dtype, device=q.device)
    grid = (groups, num_kv_heads, triton.cdiv(length * group, block_m))
    _prefill_attention_kernel[grid](
        q, k, v, out, length, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), head_dim**-0.5, GROUP=group, HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _extend_attention_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, starts_ptr, lengths_ptr, out_ptr, stride_qg, stride_qt,
                             stride_bt, stride_og, stride_ot, scale, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                             HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One (prompt, KV head, block of packed query rows) of a prefill after a prefix-cache hit:
    row r is suffix token r // GROUP (at position start + r // GROUP) and query head
    kv_head * GROUP + r % GROUP; it attends to every cached position up to its own, read through
    the prompt's block table (the suffix's keys and values are in the cache already), once for
    all the block's rows."""
    prompt = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_row = tl.program_id(2) * BLOCK_M
    start = tl.load(starts_ptr + prompt)
    length = tl.load(lengths_ptr + prompt)
    q, token, head, row_ok, d, dim_ok = _query_rows(q_ptr, prompt, kv_head, first_row, length, stride_qg, stride_qt,
                                                    GROUP, HEAD_DIM, DIM_PAD, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    # Keys up to the block's last real query (none for a block past the suffix: scalar bounds,
    # so the loop runs no tile it does not need).
    last = tl.minimum((first_row + BLOCK_M - 1) // GROUP, length - 1)
    end = tl.where(first_row // GROUP < length, start + last + 1, 0)
    at = start + token
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, DIM_PAD), tl.float32)
    for first in range(0, end, BLOCK_N):
        k, v, ok = _kv_tile(kc_ptr, vc_ptr, bt_ptr, prompt, stride_bt, kv_head, first, end, n, d, dim_ok,
                            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        # (padding rows see position 0 only: finite, and never stored)
        visible = ((first + n)[None, :] <= tl.where(row_ok, at, 0)[:, None]) & ok[None, :]
        m, l, acc = _attend_tile(q, k, v, visible, m, l, acc, scale, IEEE)
    _store_rows(out_ptr, acc, l, prompt, token, head, row_ok, d, dim_ok, stride_og, stride_ot, HEAD_DIM)


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     starts: torch.Tensor, lengths: torch.Tensor, block_size: int, block_m: int = 64,
                     block_n: int | None = None, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """`TorchOps.context_attention` on a GPU: q [G, S, H, D] (heads contiguous, D apart) holds
    tokens starts[g].. of prompt g (lengths[g] of them, right-padded), whose keys and values and
    those of every token before them are in the paged cache [slots, Hkv, D] at block_tables
    [G, W] -> [G, S, H*D] (padding rows unwritten). The cached prefix is read where it is, once
    per block of query rows, not gathered into a dense copy."""
    groups, length, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if q.stride(3) != 1 or q.stride(2) != head_dim:
        raise ValueError(f"extend_attention: q's heads must be contiguous, got strides {q.stride()}")
    group = num_heads // num_kv_heads
    if block_n is None:
        block_n = 64 if q.element_size() == 2 else 32  # float32 tiles twice the bytes
    out = torch.empty(groups, length, num_heads * head_dim, dtype=q.dtype, device=q.device)
    tables = block_tables.contiguous()
    grid = (groups, num_kv_heads, triton.cdiv(length * group, block_m))
    _extend_attention_kernel[grid](
        q, k_cache, v_cache, tables, starts.contiguous(), lengths.contiguous(), out, q.stride(0), q.stride(1),
        tables.stride(0), out.stride(0), out.stride(1), head_dim**-0.5, NUM_KV_HEADS=num_kv_heads, GROUP=group,
        HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages)
    return out
