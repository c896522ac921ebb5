"""Triton kernels for the paged forward on a GPU, with the same signatures as `ops.TorchOps`.

Decode is bound by reading the weights once per step, so what matters besides the matrix
products is how many kernels a step launches, that none of them waits on the host, and that
each starts before the one before it ends (programmatic dependent launch, Hopper on):
- `add_rmsnorm`: residual add and RMSNorm in one pass (one kernel instead of five);
- `qk_rope_cache`: Qwen3's q/k norm, RoPE, and the key/value store into the paged cache (prefill,
  which attends to the rotated q and k it returns);
- `decode_attention`: split-K paged attention for one query token per row; each program takes
  one KV head and all the query heads that share it, reading each cached key once, and the
  last split of a row to finish merges them (one launch);
- `rope_decode_attention`: the decode step's: the same kernel doing `qk_rope_cache`'s work for
  its own heads on the way (one kernel a layer fewer, the new token's slot found through the
  block table), reading what earlier kernels wrote (the first tile of cached keys and values)
  before it waits for the q/k/v product;
- `silu_mul`: the gated MLP's activation;
- `skinny_linear`: a small batch's attention products, their weights fetched into L2 while the
  kernel before still runs; `tile_linear` the same products for larger batches, in plain tiles;
- `sample`: logsumexp, the seeded draw's sums and the chosen token's logprob in one read of the
  logits, the draw itself in the kernel that records the token (see `sampling.py` for the draw
  and the hash it shares with the torch version).
Every kernel rounds where the decoder rounds (see `ops.py`), so bf16 results track the eager model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services import devices

from services.rollout.builtin import sampling
from services.rollout.builtin.prefill_attention import prefill_attention
from services.rollout.builtin.ops import TorchOps


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_res, stride_out,
                        eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.extra.cuda.gdc_wait()  # x and the residual come from the kernel before
    tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(res_out_ptr + row * stride_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(x.dtype), mask=mask)


@triton.jit
def _head_rmsnorm(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr):
    """Qwen3's per-head RMSNorm of heads given as halves x1, x2 [heads, D/2] (rows: heads),
    rounded as the decoder rounds: normalised in float32, cast, times the weight, cast."""
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM + eps)[:, None]
    return ((w1.to(tl.float32) * (f1 * rstd).to(dtype).to(tl.float32)).to(dtype),
            (w2.to(tl.float32) * (f2 * rstd).to(dtype).to(tl.float32)).to(dtype))


@triton.jit
def _rotate_halves(x1, x2, cos, sin):
    """x * cos + rotate_half(x) * sin on halves, rounded after each product and the sum as in
    bf16 torch (cos and sin already in x's dtype, as float32)."""
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    o1 = ((f1 * cos).to(dtype).to(tl.float32) + (-f2 * sin).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((f2 * cos).to(dtype).to(tl.float32) + (f1 * sin).to(dtype).to(tl.float32)).to(dtype)
    return o1, o2


@triton.jit
def _cos_sin(table_ptr, pos, d, dm, dtype, HALF: tl.constexpr):
    """cos and sin [.., D/2] of position `pos` from `ops.rope_table`, rounded to the model's dtype."""
    cos = tl.load(table_ptr + pos * (2 * HALF) + d, mask=dm, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(table_ptr + pos * (2 * HALF) + HALF + d, mask=dm, other=0.0).to(dtype).to(tl.float32)
    return cos, sin


@triton.jit
def _qk_rope_cache_kernel(q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, table_ptr, pos_ptr, slot_ptr, kc_ptr, vc_ptr,
                          qk_out_ptr, stride_q, stride_k, stride_v, eps, NUM_HEADS: tl.constexpr,
                          NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                          QK_PAD: tl.constexpr, KV_PAD: tl.constexpr, QK_NORM: tl.constexpr):
    """One program per token, all its heads at once: rows are q heads then k heads, written
    rotated to qk_out [T, H + Hkv, D] (the k heads to the cache too)."""
    token = tl.program_id(0)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    h = tl.arange(0, QK_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    dm = d < HALF
    head_dim = 2 * HALF
    is_q = h < NUM_HEADS
    is_k = (h >= NUM_HEADS) & (h < NUM_HEADS + NUM_KV_HEADS)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    q_base = q_ptr + token * stride_q + h * head_dim
    k_base = k_ptr + token * stride_k + (h - NUM_HEADS) * head_dim
    x1 = tl.where(is_q, tl.load(q_base + d, mask=is_q & dm, other=0.0), tl.load(k_base + d, mask=is_k & dm, other=0.0))
    x2 = tl.where(is_q, tl.load(q_base + HALF + d, mask=is_q & dm, other=0.0),
                  tl.load(k_base + HALF + d, mask=is_k & dm, other=0.0))
    if QK_NORM:
        w1 = tl.where(is_q, tl.load(qn_ptr + d, mask=dm, other=0.0), tl.load(kn_ptr + d, mask=dm, other=0.0))
        w2 = tl.where(is_q, tl.load(qn_ptr + HALF + d, mask=dm, other=0.0), tl.load(kn_ptr + HALF + d, mask=dm, other=0.0))
        x1, x2 = _head_rmsnorm(x1, x2, w1, w2, eps, head_dim)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos, sin = _cos_sin(table_ptr, pos, d, dm, x1.dtype, HALF)
    o1, o2 = _rotate_halves(x1, x2, cos, sin)
    qk_out = qk_out_ptr + (token * (NUM_HEADS + NUM_KV_HEADS) + h) * head_dim
    k_out = kc_ptr + (slot * NUM_KV_HEADS + h - NUM_HEADS) * head_dim
    tl.store(qk_out + d, o1, mask=(is_q | is_k) & dm)
    tl.store(qk_out + HALF + d, o2, mask=(is_q | is_k) & dm)
    tl.store(k_out + d, o1, mask=is_k & dm)
    tl.store(k_out + HALF + d, o2, mask=is_k & dm)
    kv = tl.arange(0, KV_PAD)[:, None]
    vm = (kv < NUM_KV_HEADS) & dm
    src = v_ptr + token * stride_v + kv * head_dim
    dst = vc_ptr + (slot * NUM_KV_HEADS + kv) * head_dim
    tl.store(dst + d, tl.load(src + d, mask=vm), mask=vm)
    tl.store(dst + HALF + d, tl.load(src + HALF + d, mask=vm), mask=vm)


@triton.jit
def _rope_heads(x_ptr, rows, n_rows, w_ptr, eps, cos, sin, half, QK_NORM: tl.constexpr, HALF: tl.constexpr):
    """Heads `rows` [R] at x_ptr (each HEAD_DIM = 2 HALF wide), normalised (Qwen3) and rotated,
    as [R, HEAD_DIM]: the halves joined back in place."""
    ok = (rows < n_rows)[:, None]
    x1 = tl.load(x_ptr + rows[:, None] * (2 * HALF) + half[None, :], mask=ok, other=0.0)
    x2 = tl.load(x_ptr + rows[:, None] * (2 * HALF) + HALF + half[None, :], mask=ok, other=0.0)
    if QK_NORM:
        x1, x2 = _head_rmsnorm(x1, x2, tl.load(w_ptr + half)[None, :], tl.load(w_ptr + HALF + half)[None, :], eps,
                               2 * HALF)
    o1, o2 = _rotate_halves(x1, x2, cos, sin)
    return tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (o1.shape[0], 2 * HALF))  # [R, 2, HALF] -> [R, D]


@triton.jit
def _kv_tile(kc_ptr, vc_ptr, bt_ptr, row, stride_bt, kv_head, first, limit, n, d, dim_ok, NUM_KV_HEADS: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Cached keys and values [BLOCK_N, D] of one KV head at a row's positions first + n below
    `limit`, through its block table, and which of them are real."""
    t = first + n
    ok = t < limit
    block = tl.load(bt_ptr + row * stride_bt + t // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + t % BLOCK_SIZE
    offs = (slot * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
    kv_ok = ok[:, None] & dim_ok[None, :]
    return tl.load(kc_ptr + offs, mask=kv_ok, other=0.0), tl.load(vc_ptr + offs, mask=kv_ok, other=0.0), ok


@triton.jit
def _attend_tile(q, k, v, ok, m, l, acc, scale, IEEE: tl.constexpr):
    """One tile of the online softmax: q [G, D] against keys and values [N, D] (`ok` the real
    ones), updating the running max m, sum l [G] and output acc [G, D]."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, N]
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def _decode_attention_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, pos_ptr, out_ptr, acc_ptr, ml_ptr, count_ptr, stride_bt,
                             scale, k_ptr, v_ptr, qn_ptr, kn_ptr, table_ptr, stride_q, stride_k, stride_v,
                             eps, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                             GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                             IEEE: tl.constexpr, ROPE: tl.constexpr, QK_NORM: tl.constexpr,
                             PRELOAD: tl.constexpr):
    """One (row, KV head, split): attention of the GROUP query heads over the split's share of
    the row's cached tokens (a row's length is its query token's position, at pos_ptr, + 1). With
    several splits each writes its partial result, and the last to finish (an atomic count per row
    and KV head) merges them: one launch either way.

    With ROPE, q, k and v are the row's new token straight from the q/k/v product (q [b, H D]
    at q_ptr, k and v [b, Hkv D]), and the kernel does what `qk_rope_cache` would have done
    first: every program normalises (Qwen3) and rotates its query heads, and the program whose
    share holds the new token (the row's last position) rotates its key, writes key and value
    to the cache for later steps, and attends to them from registers. One kernel a layer fewer."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    head_ok = g < GROUP
    dim_ok = d < HEAD_DIM
    # Positions, block tables and the cached keys and values were written by earlier kernels, which
    # had finished before the kernel before this one passed its own wait: read them before ours.
    seq_len = tl.load(pos_ptr + row) + 1
    chunk = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if ROPE:
        cached_end = tl.minimum(end, seq_len - 1)  # the new token is not in the cache yet
        k0, v0, ok0 = _kv_tile(kc_ptr, vc_ptr, bt_ptr, row, stride_bt, kv_head, start, cached_end, n, d, dim_ok,
                               NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)  # the first tile, ahead of the wait
        if PRELOAD == 2:  # and the second
            k1, v1, ok1 = _kv_tile(kc_ptr, vc_ptr, bt_ptr, row, stride_bt, kv_head, start + BLOCK_N, cached_end, n,
                                   d, dim_ok, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        half = tl.arange(0, HEAD_DIM // 2)
        cos, sin = _cos_sin(table_ptr, (seq_len - 1).to(tl.int64), half[None, :], True, q_ptr.dtype.element_ty,
                            HEAD_DIM // 2)
        owner = (start < seq_len) & (seq_len <= end)  # this share holds the new token
        block_new = tl.load(bt_ptr + row * stride_bt + (seq_len - 1) // BLOCK_SIZE, mask=owner, other=0).to(tl.int64)
        slot_new = block_new * BLOCK_SIZE + (seq_len - 1) % BLOCK_SIZE  # where the new key and value go
    else:
        cached_end = end
    tl.extra.cuda.gdc_wait()  # q (k, v) come from the kernel before
    tl.extra.cuda.gdc_launch_dependents()
    m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
    loop_start = start
    if ROPE:
        q = _rope_heads(q_ptr + row * stride_q + kv_head * GROUP * HEAD_DIM, g, GROUP, qn_ptr, eps, cos, sin, half,
                        QK_NORM, HEAD_DIM // 2)
        # The new token first: its key rotated, key and value stored for later steps, and
        # attended to from registers (the owner's running max, sum and output start from it).
        one = tl.arange(0, 1)
        k_new = _rope_heads(k_ptr + row * stride_k + kv_head * HEAD_DIM, one, owner.to(tl.int32), kn_ptr, eps, cos,
                            sin, half, QK_NORM, HEAD_DIM // 2)  # [1, D]
        v_new = tl.load(v_ptr + row * stride_v + kv_head * HEAD_DIM + d[None, :], mask=owner, other=0.0)  # [1, D]
        at = (slot_new * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        tl.store(kc_ptr + at, k_new, mask=owner)
        tl.store(vc_ptr + at, v_new, mask=owner)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), axis=1) * scale  # [GROUP_PAD]
        m = tl.where(owner, s_new, m)
        l = tl.where(owner, 1.0, l)
        acc = tl.where(owner, acc + v_new.to(tl.float32), acc)
        if start < cached_end:
            m, l, acc = _attend_tile(q, k0, v0, ok0, m, l, acc, scale, IEEE)
        loop_start = start + BLOCK_N
        if PRELOAD == 2:
            if loop_start < cached_end:
                m, l, acc = _attend_tile(q, k1, v1, ok1, m, l, acc, scale, IEEE)
            loop_start += BLOCK_N
    else:
        q = tl.load(q_ptr + (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :],
                    mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    for first in range(loop_start, cached_end, BLOCK_N):
        k, v, ok = _kv_tile(kc_ptr, vc_ptr, bt_ptr, row, stride_bt, kv_head, first, cached_end, n, d, dim_ok,
                            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        m, l, acc = _attend_tile(q, k, v, ok, m, l, acc, scale, IEEE)
    out_offs = (row * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :]
    out_ok = head_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + out_offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok)
    else:
        part = (row * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(acc_ptr + part[:, None] * DIM_PAD + d[None, :], acc, mask=head_ok[:, None])
        tl.store(ml_ptr + part * 2, m, mask=head_ok)
        tl.store(ml_ptr + part * 2 + 1, l, mask=head_ok)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        counter = count_ptr + row * NUM_KV_HEADS + kv_head
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
            tl.debug_barrier()
            top = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
            total = tl.zeros((GROUP_PAD,), tl.float32)
            merged = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
            base = (row * NUM_HEADS + heads) * NUM_SPLITS
            for other in tl.static_range(NUM_SPLITS):
                m_s = tl.load(ml_ptr + (base + other) * 2, mask=head_ok, other=float("-inf"), cache_modifier=".cg")
                l_s = tl.load(ml_ptr + (base + other) * 2 + 1, mask=head_ok, other=0.0, cache_modifier=".cg")
                a_s = tl.load(acc_ptr + (base + other)[:, None] * DIM_PAD + d[None, :], mask=head_ok[:, None],
                              other=0.0, cache_modifier=".cg")
                new_top = tl.maximum(top, m_s)
                keep = tl.where(new_top > float("-inf"), tl.exp(top - new_top), 0.0)
                take = tl.where(m_s > float("-inf"), tl.exp(m_s - new_top), 0.0)
                total = total * keep + l_s * take
                merged = merged * keep[:, None] + a_s * take[:, None]
                top = new_top
            tl.store(out_ptr + out_offs, (merged / total[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _silu_times(gate, up):
    """silu(gate) * up, rounded as the decoder rounds: the activation to gate's dtype, then the product."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_gate, stride_up, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, _silu_times(gate, up), mask=mask)


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
    program instead measured the same for q/k/v and o, and worse for the MLP products; see
    bench/results/skinny_pdl-experiment-5-*.) With SILU, x is silu(gate) * up of the gated MLP
    (gate at x, up `up_offset` columns on), rounded as `silu_mul` rounds. With SPLITS > 1 each program writes its float32 partial
    and the last of a column block's programs to finish (an atomic count) adds them in split
    order: one launch, and the same sum whatever order the programs finish in."""
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


@triton.jit
def _hash32(x):
    """`sampling.hash32` in uint32: products wrap at 2**32, as the reference's masks make them."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _max_sum_exp2(x, weight):
    """max(x) and the sum of weight * exp2(x - max) over a block, x in log2 units (-inf: nothing):
    partial maxima and sums merged into one, or, with weight 1, a block's own."""
    top = tl.max(x, axis=0)
    return top, tl.sum(tl.where(x > float("-inf"), weight * tl.exp2(x - top), 0.0), axis=0)


@triton.jit
def _sample_chunk_kernel(logits_ptr, scores_ptr, inv_temp_ptr, part_ptr, tok_part_ptr, vocab, stride_logits,
                         stride_scores, NUM_CHUNKS: tl.constexpr, GREEDY: tl.constexpr, SCALE_SCORES: tl.constexpr,
                         CHUNK: tl.constexpr):
    """One vocabulary chunk of one row, read once and whole (one round trip to memory, so that
    enough bytes are in flight for the bandwidth): the max and exp-sum of the raw logits (for the
    logprob's logsumexp) and, greedy, the best logit and its token, or, sampling, the max and
    exp-sum of the scores (for the draw's running sums, `sampling.py`), in log2 units. At
    temperature 1 the scores are the logits: one sum serves both."""
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0)
    c = tl.program_id(1)
    v = c * CHUNK + tl.arange(0, CHUNK)
    ok = v < vocab
    inv_temp = tl.load(inv_temp_ptr)
    tl.extra.cuda.gdc_wait()  # the logits' product has finished
    tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(logits_ptr + row * stride_logits + v, mask=ok, other=float("-inf")).to(tl.float32)
    chunk_max, chunk_total = _max_sum_exp2(x * LOG2E, 1.0)
    part = (row * NUM_CHUNKS + c) * 4
    tl.store(part_ptr + part, chunk_max)
    tl.store(part_ptr + part + 1, chunk_total)
    if GREEDY:
        best = tl.max(x, axis=0)
        tl.store(part_ptr + part + 2, best)
        tl.store(tok_part_ptr + row * NUM_CHUNKS + c, tl.min(tl.where(x == best, v, 2147483647), axis=0))  # lowest id
    else:
        score_max, score_total = chunk_max, chunk_total
        if SCALE_SCORES:
            if inv_temp != 1.0:
                score_max, score_total = _max_sum_exp2(x * (inv_temp * LOG2E), 1.0)
        else:
            score = tl.load(scores_ptr + row * stride_scores + v, mask=ok, other=float("-inf")).to(tl.float32)
            score_max, score_total = _max_sum_exp2(score * LOG2E, 1.0)
        tl.store(part_ptr + part + 2, score_max)
        tl.store(part_ptr + part + 3, score_total)


@triton.jit
def _merge_chunks(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores, inv_temp, key, step,
                  vocab, r, NUM_CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, GREEDY: tl.constexpr,
                  SCALE_SCORES: tl.constexpr, CHUNK: tl.constexpr):
    """Row r's token and the raw logprob of it. Greedy: the best logit over the chunks (the
    lowest id on a tie). Sampling (`sampling.draw`): u from the (key, step) hash picks the chunk
    whose running sum of chunk totals passes u times the row's total, then the token in it whose
    running sum of weights passes what is left (the chunk's weights summed again here, in the
    same units; if rounding leaves the target past their sum, the chunk's last token of weight
    above 0)."""
    LN2: tl.constexpr = 0.6931471805599453
    LOG2E: tl.constexpr = 1.4426950408889634
    c = tl.arange(0, CHUNKS_PAD)
    ok = c < NUM_CHUNKS
    part = (r * NUM_CHUNKS + c) * 4
    m = tl.load(part_ptr + part, mask=ok, other=float("-inf"))
    total = tl.load(part_ptr + part + 1, mask=ok, other=0.0)
    top, row_total = _max_sum_exp2(m, total)
    lse = (top + tl.log2(row_total)) * LN2
    if GREEDY:
        best = tl.load(part_ptr + part + 2, mask=ok, other=float("-inf"))
        toks = tl.load(tok_part_ptr + r * NUM_CHUNKS + c, mask=ok, other=2147483647)
        token = tl.min(tl.where(best == tl.max(best, axis=0), toks, 2147483647), axis=0)  # chunks hold ascending ids
    else:
        score_max = tl.load(part_ptr + part + 2, mask=ok, other=float("-inf"))
        score_total = tl.load(part_ptr + part + 3, mask=ok, other=0.0)
        big = tl.max(score_max, axis=0)
        shares = tl.where(score_max > float("-inf"), score_total * tl.exp2(score_max - big), 0.0)
        running = tl.cumsum(shares, axis=0)
        bits = _hash32(key + step * 0x9E3779B9) >> 8
        target = ((bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)) * tl.max(running, axis=0)
        pick = tl.min(tl.where((running > target) & ok, c, CHUNKS_PAD), axis=0)
        pick = tl.where(pick == CHUNKS_PAD, tl.max(tl.where(shares > 0, c, 0), axis=0), pick)
        target -= tl.sum(tl.where(c == pick, running - shares, 0.0), axis=0)
        v = pick * CHUNK + tl.arange(0, CHUNK)
        v_ok = v < vocab
        if SCALE_SCORES:
            score = tl.load(logits_ptr + r * stride_logits + v, mask=v_ok, other=float("-inf")).to(tl.float32) * (
                inv_temp * LOG2E)
        else:
            score = tl.load(scores_ptr + r * stride_scores + v, mask=v_ok, other=float("-inf")).to(tl.float32) * LOG2E
        weight = tl.where(score > float("-inf"), tl.exp2(score - big), 0.0)
        passed = (tl.cumsum(weight, axis=0) > target) & (weight > 0)
        token = tl.min(tl.where(passed, v, 2147483647), axis=0)
        token = tl.where(token == 2147483647, tl.max(tl.where(weight > 0, v, 0), axis=0), token)
    logprob = tl.load(logits_ptr + r * stride_logits + token).to(tl.float32) - lse
    return token, logprob


@triton.jit
def _sample_merge_kernel(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores, inv_temp_ptr,
                         keys_ptr, steps_ptr, tok_ptr, lp_ptr, vocab, NUM_CHUNKS: tl.constexpr,
                         CHUNKS_PAD: tl.constexpr, GREEDY: tl.constexpr, SCALE_SCORES: tl.constexpr,
                         CHUNK: tl.constexpr):
    row = tl.program_id(0)
    token, logprob = _merge_chunks(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores,
                                   tl.load(inv_temp_ptr), tl.load(keys_ptr + row).to(tl.uint32),
                                   tl.load(steps_ptr + row).to(tl.uint32), vocab, row, NUM_CHUNKS, CHUNKS_PAD, GREEDY,
                                   SCALE_SCORES, CHUNK)
    tl.store(tok_ptr + row, token.to(tl.int64))
    tl.store(lp_ptr + row, logprob)


@triton.jit
def _sample_record_kernel(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores, inv_temp_ptr,
                          keys_ptr, vocab, start, tokens_ptr, positions_ptr, made_ptr, done_ptr, out_tok_ptr,
                          out_lp_ptr, out_width, limit_ptr, is_stop_ptr, NUM_CHUNKS: tl.constexpr,
                          CHUNKS_PAD: tl.constexpr, GREEDY: tl.constexpr, SCALE_SCORES: tl.constexpr,
                          CHUNK: tl.constexpr):
    """Merge a row's chunks into its token and logprob, and record them (as
    `TorchOps.sample_and_record` does), all in one program per row. The draw's step is the
    row's tokens made so far."""
    r = tl.program_id(0)
    row = start + r
    key = tl.load(keys_ptr + row).to(tl.uint32)
    inv_temp = tl.load(inv_temp_ptr)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    made = tl.load(made_ptr + row)
    token, logprob = _merge_chunks(part_ptr, tok_part_ptr, logits_ptr, scores_ptr, stride_logits, stride_scores,
                                   inv_temp, key, made.to(tl.uint32), vocab, r, NUM_CHUNKS, CHUNKS_PAD, GREEDY,
                                   SCALE_SCORES, CHUNK)
    active = tl.load(done_ptr + row) == 0
    if active:
        at = tl.minimum(made, out_width - 1).to(tl.int64)
        tl.store(out_tok_ptr + row * out_width + at, token.to(tl.int64))
        tl.store(out_lp_ptr + row * out_width + at, logprob)
        made += 1
        stop = tl.load(is_stop_ptr + token) != 0
        tl.store(made_ptr + row, made)
        tl.store(done_ptr + row, (stop | (made >= tl.load(limit_ptr))).to(tl.int1))
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(positions_ptr + row, tl.load(positions_ptr + row) + 1)


class TritonOps(TorchOps):
    """The GPU ops: each a Triton kernel with the reference's signature (top-k / top-p filtering
    stays on torch: sorting is already a kernel, and so does the prefill attention of long prompts)."""

    name = "triton"
    # Attention tile when a row is not split (large batches). On long rows longer tiles pay:
    # H200, RL-shaped rows of up to 1500 tokens, 0.5B 59.9k -> 64.7k tokens/s, 1.5B 37.5k ->
    # 41.0k (bench/experiments/attention_tile_rl.py); on rows under 200 tokens they cost the 1.5B
    # step ~1%. Split rows (small batches) keep 32, the fastest there, as do float32 and heads
    # wider than 128, whose 64-row tiles may not fit shared memory. A tile is at most 16 KB of
    # keys: 128 tokens only for heads up to 64 wide. 128 measured on an H100: RL-shaped 0.5B
    # +3-6% (65.3k -> 67.3k-69.5k tokens/s), the sweep's batch 256 -5% (1522 -> 1604 us a step;
    # its two 64 KB pipeline stages leave room for 3 programs an SM), with one stage the sweep
    # the same and RL -8% (bench/results/attention_*-experiment-*-nvidia-h100-*): kept at 64.
    unsplit_tile = 64
    attention_warps = 4  # 2 warps or 3 stages: within 2% (bench/results/attention_splits-experiment-*)
    attention_stages = 2
    # A decode attention program (RoPE inside) loads its first cached key/value tile before its
    # wait, and its second too where a tile is at most `attention_preload_max_bytes` and rows
    # are split in at most `attention_preload_max_splits` shares (more shares: a share of a
    # short row is one tile, the second would be empty and only cost registers). H200, decode
    # step, one tile -> two: 0.5B batch 256 1313 -> 1278 us, batch 64 882 -> 863 (3 shares of
    # 32-token tiles), batch 16 790 -> 793 (9 shares); 1.5B batch 64 1694 -> 1656, batch 16 1481
    # -> 1487, batch 256 2533 -> 2689 (its 16 KB tiles: 128-wide heads, 64 tokens)
    # (bench/experiments/knob_step.py, bench/results/attention_preload-experiment-*).
    attention_preload_max_bytes = 8 << 10
    attention_preload_max_splits = 4
    # A decode step's RoPE and key/value store inside the attention kernel (one kernel a layer fewer).
    fuse_rope = True
    # Products of at most `skinny_rows` rows (a small batch's decode step) whose weight is at most
    # `skinny_max_bytes` run as `_skinny_linear_kernel` (bf16 and fp16); the rest go to cuBLAS.
    # That kernel asks L2 for its weight while the kernel before it still runs, which pays where
    # a product is too small to reach the bandwidth: the attention's q/k/v and o products. On
    # the MLP's (9-55 MB) cuBLAS streams better. H200, decode step at batch 16, 0.5B shape:
    # cuBLAS 983 us, all products skinny 997, those up to 8 MB 918, up to 10 MB 937; 1.5B 1690,
    # 2085, 1622 (bench/experiments/skinny_pdl.py, bench/results/skinny_pdl-experiment-*.txt).
    # Past 16 rows the kernel takes row tiles of 32 or 64, and loses to cuBLAS: q/k/v and o on it
    # at every batch, 0.5B batch 256 1399 -> 1530 us, 1.5B batch 64 1762 -> 1876; only 0.5B batch
    # 64 gains (1000 -> 973). Hence 16 (skinny_pdl-experiment-7-*).
    skinny_rows = 16
    skinny_max_bytes = 8 << 20
    skinny_block_n = 64  # weight rows per program: one warpgroup's matrix-unit tile (n32: 0.5B 947 us)
    skinny_block_k = 128
    skinny_warps = 4
    skinny_stages = 3
    # Products of more rows than that, up to `tile_max_rows`, whose weight is at most
    # `tile_max_bytes` (`tile_wide_max_bytes` past `tile_wide_rows` rows) run as
    # `_tile_linear_kernel` in tiles of 64 rows by 32 columns: the attention's q/k/v and o. Timed
    # alone it only matches cuBLAS (0.5B q/k/v at 256 rows: 5.1 against 5.0 us), but launched
    # with PDL it starts, and asks L2 for its weight, while the norm or the attention before it
    # still runs. H200, decode step: 0.5B batch 64 972 -> 865 us, batch 256 1332 -> 1285; 1.5B
    # batch 64 1736 -> 1665, but batch 256 (4.7-6.3 MB weights) 2470 -> 2690, hence the smaller
    # bound past 64 rows (batches 32 and 128 were not measured: 128 keeps cuBLAS for the 1.5B
    # shape, as before). 64 x 64 tiles, or no L2 request, were within 1% at batch 256 and slower
    # at 64; the MLP's down product on it (k in 4 shares) gained nothing
    # (bench/experiments/tile_step.py, bench/results/tile_step-experiment-*).
    tile_max_rows = 512
    tile_max_bytes = 8 << 20
    tile_wide_rows = 64
    tile_wide_max_bytes = 3 << 20
    tile_block = (64, 32, 128)  # BLOCK_M, BLOCK_N, BLOCK_K
    tile_warps = 4
    tile_stages = 3
    # Prefill attention of prompts up to this many tokens (the padded length) on
    # `prefill_attention.py`'s kernel, longer ones on SDPA's (cuDNN's) kernel. H200, a call
    # prefilling 256 prompts of 64 tokens: 0.5B 28.45 -> 27.38 ms, 1.5B 76.4 -> 76.0; of 128
    # tokens even (0.5B 50.9 -> 50.7, 1.5B 147.3 -> 148.5); 64 of 512: 0.5B 50.6 -> 52.0, 1.5B
    # 149.9 -> 153.9 (bench/experiments/prefill_ab.py, bench/results/prefill_ab-experiment-*).
    prefill_kernel_max_len = 64

    # Warps a program of the norm (a row), the sampling chunk kernel (sampling.CHUNK tokens) and
    # the SiLU (1024 columns). H200, 0.5B decode step (bench/experiments/knob_step.py,
    # bench/results/knob_step-experiment-*): norm 1, 2 or 4 and SiLU 1 or 4 within the spread at
    # batch 256, SiLU 1 slower at 16 (794 -> 808 us); sampling 4 instead of 8 1283 -> 1270 us at
    # batch 256 (both rounds), the same at 16: not taken yet, the GPU tests have not run with it.
    norm_warps = 4
    sample_warps = 8
    silu_warps = 4

    def add_rmsnorm(self, x, residual, weight, eps):
        rows, cols = x.shape
        out = torch.empty_like(x)
        res_out = torch.empty_like(x)
        has_res = residual is not None
        _add_rmsnorm_kernel[(rows,)](x, residual if has_res else x, weight, out, res_out, cols, x.stride(0),
                                     residual.stride(0) if has_res else 0, out.stride(0), eps,
                                     HAS_RESIDUAL=has_res, BLOCK=triton.next_power_of_2(cols),
                                     num_warps=self.norm_warps, launch_pdl=self.pdl)
        return out, res_out

    def qk_rope_cache(self, q, k, v, q_norm, k_norm, eps, table, positions, slots, k_cache, v_cache):
        tokens = q.shape[0]
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        num_heads = q.shape[1] // head_dim
        qk_out = torch.empty(tokens, num_heads + num_kv_heads, head_dim, dtype=q.dtype, device=q.device)
        norm = q_norm is not None
        _qk_rope_cache_kernel[(tokens,)](
            q, k, v, q_norm if norm else q, k_norm if norm else q, table, positions, slots, k_cache, v_cache, qk_out,
            q.stride(0), k.stride(0), v.stride(0), eps, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
            HALF=head_dim // 2, HALF_PAD=triton.next_power_of_2(head_dim // 2),
            QK_PAD=triton.next_power_of_2(num_heads + num_kv_heads), KV_PAD=triton.next_power_of_2(num_kv_heads),
            QK_NORM=norm, num_warps=4, launch_pdl=self.pdl)
        return qk_out[:, :num_heads], qk_out[:, num_heads:]

    def prefill_attention(self, q, k, v):
        head_dim = q.shape[3]
        if (q.shape[1] > self.prefill_kernel_max_len or head_dim > 128
                or any(t.stride(3) != 1 or t.stride(2) != head_dim for t in (q, k, v))):
            return super().prefill_attention(q, k, v)
        return prefill_attention(q, k, v)

    def __init__(self, pdl: bool | None = None):
        self._counters: dict[tuple, torch.Tensor] = {}
        # Programmatic dependent launch (Hopper on): the kernels that wait for their predecessor
        # with `gdc_wait` (norm, RoPE, attention, skinny products) are launched so that they may
        # start before it ends; captured graphs keep that. With cuBLAS products alone it took the
        # H200 decode step from 1005 to 983 us (0.5B, batch 16) and 2671 to 2635 (1.5B, batch 256).
        if pdl is None:
            pdl = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
        self.pdl = pdl

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, block_size, num_splits):
        return self._attention(q, k_cache, v_cache, block_tables, seq_lens - 1, block_size, num_splits)

    def rope_decode_attention(self, q, k, v, q_norm, k_norm, eps, table, positions, k_cache, v_cache, block_tables,
                              block_size, num_splits):
        head_dim = k_cache.shape[2]
        # The heads' halves are joined back in registers: power-of-two heads of 32 or more
        # (the matrix unit's 16 a half). Other shapes, and `fuse_rope` off, take two kernels.
        if not (self.fuse_rope and head_dim >= 32 and head_dim & (head_dim - 1) == 0
                and q.stride(1) == k.stride(1) == v.stride(1) == 1):
            return super().rope_decode_attention(q, k, v, q_norm, k_norm, eps, table, positions, k_cache, v_cache,
                                                 block_tables, block_size, num_splits)
        return self._attention(q, k_cache, v_cache, block_tables, positions, block_size, num_splits,
                               rope=(k, v, q_norm, k_norm, eps, table))

    def _attention(self, q, k_cache, v_cache, block_tables, positions, block_size, num_splits, rope=None):
        """q [b, H, D] rotated, or with `rope` (k, v, q_norm, k_norm, eps, table) q [b, H*D]
        straight from the product, of the token at `positions` [b] (int32) of each row: its
        cache slot is found through the block table in the kernel."""
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        batch, num_heads = q.shape[0], (q.shape[1] // head_dim if rope else q.shape[1])
        unread = q  # the pointers a variant does not read
        k, v, q_norm, k_norm, eps, table = rope or (unread, unread, None, None, 0.0, unread)
        group = num_heads // num_kv_heads
        dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs 16 at least
        device = k_cache.device
        acc = torch.empty(batch, num_heads, num_splits, dim_pad, dtype=torch.float32, device=device)
        ml = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32, device=device)
        out = torch.empty(batch, num_heads * head_dim, dtype=k_cache.dtype, device=device)
        block_n = 32
        if num_splits == 1 and k_cache.element_size() == 2 and head_dim <= 128:
            block_n = min(self.unsplit_tile, 8192 // head_dim)  # a tile of keys 16 KB at most
        preload = 1
        if (block_n * head_dim * k_cache.element_size() <= self.attention_preload_max_bytes
                and num_splits <= self.attention_preload_max_splits):
            preload = 2
        _decode_attention_kernel[(batch, num_kv_heads, num_splits)](
            q, k_cache, v_cache, block_tables, positions, out, acc, ml,
            self._counter(device, batch * num_kv_heads, "attention"), block_tables.stride(0), head_dim**-0.5,
            k, v, unread if q_norm is None else q_norm, unread if k_norm is None else k_norm, table, q.stride(0),
            k.stride(0), v.stride(0), eps, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
            BLOCK_N=block_n, NUM_SPLITS=num_splits, IEEE=k_cache.dtype == torch.float32, ROPE=rope is not None,
            QK_NORM=q_norm is not None, PRELOAD=preload, num_warps=self.attention_warps,
            num_stages=self.attention_stages, launch_pdl=self.pdl)
        return out

    def _counter(self, device: torch.device, size: int, kind: str) -> torch.Tensor:
        """Zeroed split counters that outlive every launch (each launch leaves them at zero again).
        Made at the first, eager, call of a size, never while a graph is being captured."""
        key = (device, size, kind)
        if key not in self._counters:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{kind} kernel: run it once before capturing a graph of it")
            self._counters[key] = torch.zeros(max(size, 1), dtype=torch.int32, device=device)
        return self._counters[key]

    def sample_and_record(self, logits, scores, greedy, rows, start):
        batch, vocab = logits.shape
        part, tok_part, chunks, use = self._sample_chunks(logits, rows.inv_temperature, greedy, scores)
        _sample_record_kernel[(batch,)](part, tok_part, logits, use, logits.stride(0), use.stride(0),
                                        rows.inv_temperature, rows.keys, vocab, start, rows.tokens, rows.positions,
                                        rows.num_made, rows.done, rows.out_tokens, rows.out_logprobs,
                                        rows.out_tokens.shape[1], rows.limit, rows.is_stop, NUM_CHUNKS=chunks,
                                        CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)), GREEDY=greedy,
                                        SCALE_SCORES=scores is None, CHUNK=sampling.CHUNK, num_warps=4,
                                        launch_pdl=self.pdl)

    def linear(self, x, weight, bias=None):
        if self._skinny(x, weight):
            return self._skinny_linear(x, weight, bias, silu=False)
        if self._tiled(x, weight):
            return self._tile_linear(x, weight, bias)
        return super().linear(x, weight, bias)

    def silu_mul_linear(self, gate, up, weight, bias=None):
        # gate and up are the halves of one [T, 2 I] product (`forward.fuse_projections`)
        halves = (up.data_ptr() - gate.data_ptr() == gate.shape[1] * gate.element_size()
                  and gate.stride() == up.stride() and gate.stride(1) == 1)
        if not (halves and self._skinny(gate, weight)):
            return super().silu_mul_linear(gate, up, weight, bias)
        return self._skinny_linear(gate, weight, bias, silu=True)

    def _skinny(self, x, weight) -> bool:
        return (x.shape[0] <= self.skinny_rows and x.dtype in (torch.bfloat16, torch.float16)
                and weight.numel() * weight.element_size() <= self.skinny_max_bytes
                and weight.dtype == x.dtype and weight.is_contiguous() and x.stride(1) == 1)

    def _tiled(self, x, weight) -> bool:
        rows, k = x.shape
        limit = self.tile_max_bytes if rows <= self.tile_wide_rows else self.tile_wide_max_bytes
        return (self.skinny_rows < rows <= self.tile_max_rows and x.dtype in (torch.bfloat16, torch.float16)
                and weight.numel() * weight.element_size() <= limit and k % self.tile_block[2] == 0
                and weight.dtype == x.dtype and weight.is_contiguous() and x.stride(1) == 1)

    def _tile_linear(self, x, weight, bias):
        rows, k = x.shape
        n = weight.shape[0]
        block_m, block_n, block_k = self.tile_block
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _tile_linear_kernel[(triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)](
            x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            LINES=triton.next_power_of_2(triton.cdiv(k, 64)), num_warps=self.tile_warps, num_stages=self.tile_stages,
            launch_pdl=self.pdl)
        return out

    def _skinny_linear(self, x, weight, bias, silu: bool):
        rows, k = x.shape
        n = weight.shape[0]
        block_n = self.skinny_block_n
        blocks = triton.cdiv(n, block_n)
        block_m = min(SKINNY_MAX_BLOCK_M, max(SKINNY_BLOCK_M, triton.next_power_of_2(rows)))
        row_tiles = triton.cdiv(rows, block_m)
        # Shares of k enough for ~2 programs per SM (small products need them to fetch their
        # weights in parallel), each at least 256 wide; a share starts on a 128-byte line.
        splits = max(1, min(triton.cdiv(2 * devices.sm_count(x.device), blocks * row_tiles), k // 256))
        k_split = triton.cdiv(triton.cdiv(k, splits), 64) * 64
        splits = triton.cdiv(k, k_split)
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        part = torch.empty(splits, row_tiles * block_m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
        counter = self._counter(x.device, blocks * row_tiles, "linear") if splits > 1 else out
        _skinny_linear_kernel[(blocks, splits, row_tiles)](
            x, weight, bias if bias is not None else weight, out, part, counter, rows, n, k, k_split, k, x.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, SILU=silu, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=self.skinny_block_k, LINES=triton.next_power_of_2(triton.cdiv(k_split, 64)),
            num_warps=self.skinny_warps, num_stages=self.skinny_stages, launch_pdl=self.pdl)
        return out

    def silu_mul(self, gate, up):
        rows, cols = gate.shape
        out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
        block = 1024
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate, up, out, cols, gate.stride(0), up.stride(0),
                                                          BLOCK=block, num_warps=self.silu_warps,
                                                          launch_pdl=self.pdl)
        return out

    def sample(self, logits, keys, steps, inv_temperature, greedy, scores=None):
        batch, vocab = logits.shape
        part, tok_part, chunks, use = self._sample_chunks(logits, inv_temperature, greedy, scores)
        tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
        logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
        _sample_merge_kernel[(batch,)](part, tok_part, logits, use, logits.stride(0), use.stride(0), inv_temperature,
                                       keys, steps, tokens, logprobs, vocab, NUM_CHUNKS=chunks,
                                       CHUNKS_PAD=max(2, triton.next_power_of_2(chunks)), GREEDY=greedy,
                                       SCALE_SCORES=scores is None, CHUNK=sampling.CHUNK, num_warps=4)
        return tokens, logprobs

    def _sample_chunks(self, logits, inv_temperature, greedy, scores):
        """Per (row, vocabulary chunk of `sampling.CHUNK` tokens, a fixed size so that a row's
        sums never depend on the batch): max and exp-sum of the logits, and the best logit and
        its token (greedy) or max and exp-sum of the scores (sampling)."""
        batch, vocab = logits.shape
        device = logits.device
        chunks = triton.cdiv(vocab, sampling.CHUNK)
        part = torch.empty(batch, chunks, 4, dtype=torch.float32, device=device)
        tok_part = torch.empty(batch, chunks, dtype=torch.int32, device=device)
        use = logits if scores is None else scores
        _sample_chunk_kernel[(batch, chunks)](logits, use, inv_temperature, part, tok_part, vocab, logits.stride(0),
                                              use.stride(0), NUM_CHUNKS=chunks, GREEDY=greedy,
                                              SCALE_SCORES=scores is None, CHUNK=sampling.CHUNK, num_warps=self.sample_warps,
                                              launch_pdl=self.pdl)
        return part, tok_part, chunks, use
