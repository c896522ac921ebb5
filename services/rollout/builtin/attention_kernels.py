"""Triton kernels for RoPE, the paged key/value store and decode attention (`TritonOps`'
`qk_rope_cache`, `decode_attention` and `rope_decode_attention`).

Decode attention is split-K over a row's cached tokens: each program takes one KV head and all
the query heads that share it, reading each cached key once, and the last split of a row to
finish merges the splits (one launch). In the decode step the same kernel does `qk_rope_cache`'s
work for its own heads on the way (the new token's slot found through the block table) and
reads what earlier kernels wrote (its first cached key/value tiles) before it waits for the
q/k/v product.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
    """One tile of the online softmax: q [G, D] against keys and values [N, D] (`ok` [1 or G, N]:
    which keys each query attends to), updating the running max m, sum l [G] and output acc [G, D]."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G, N]
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(ok, s, float("-inf"))
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
            m, l, acc = _attend_tile(q, k0, v0, ok0[None, :], m, l, acc, scale, IEEE)
        loop_start = start + BLOCK_N
        if PRELOAD == 2:
            if loop_start < cached_end:
                m, l, acc = _attend_tile(q, k1, v1, ok1[None, :], m, l, acc, scale, IEEE)
            loop_start += BLOCK_N
    else:
        q = tl.load(q_ptr + row * stride_q + heads[:, None] * HEAD_DIM + d[None, :],
                    mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # rows stride_q apart, as given
    for first in range(loop_start, cached_end, BLOCK_N):
        k, v, ok = _kv_tile(kc_ptr, vc_ptr, bt_ptr, row, stride_bt, kv_head, first, cached_end, n, d, dim_ok,
                            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        m, l, acc = _attend_tile(q, k, v, ok[None, :], m, l, acc, scale, IEEE)
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
