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
The kernels live by topic in `pointwise_kernels.py`, `attention_kernels.py`, `linear_kernels.py`,
`sampling_kernels.py` and `prefill_attention.py`; this module chooses between them and launches them.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
import triton

from services import devices
from services.rollout.builtin import cublaslt, sampling
from services.rollout.builtin.attention_kernels import _decode_attention_kernel, _qk_rope_cache_kernel
from services.rollout.builtin.linear_kernels import (SKINNY_BLOCK_M, SKINNY_MAX_BLOCK_M, _skinny_linear_kernel,
                                                     _tile_linear_kernel)
from services.rollout.builtin.ops import TorchOps
from services.rollout.builtin.pointwise_kernels import _add_rmsnorm_kernel, _silu_mul_kernel
from services.rollout.builtin.prefill_attention import extend_attention, prefill_attention
from services.rollout.builtin.sampling_kernels import (_sample_chunk_kernel, _sample_merge_kernel,
                                                       _sample_record_kernel)

log = logging.getLogger("rlfleet.rollout")


class TritonOps(TorchOps):
    """The GPU ops: each a Triton kernel with the reference's signature (top-k / top-p filtering
    stays on torch: sorting is already a kernel, and so does the prefill attention of long prompts)."""

    name = "triton"
    # Attention tile when a row is not split (large batches). On long rows longer tiles pay:
    # measured on an H200, RL-shaped rows of up to 1500 tokens, 32 -> 64 tokens: 0.5B 59.9k ->
    # 64.7k tokens/s, 1.5B 37.5k -> 41.0k; on rows under 200 tokens 64 costs the 1.5B step ~1%.
    # Split rows (small batches) keep 32, the fastest there, as do float32 and heads wider than
    # 128, whose 64-row tiles may not fit shared memory. A tile is at most 16 KB of keys: 128
    # tokens only for heads up to 64 wide. 128 measured on an H100: RL-shaped 0.5B +3-6% (65.3k
    # -> 67.3k-69.5k tokens/s), the sweep's batch 256 -5% (1522 -> 1604 us a step; its two 64 KB
    # pipeline stages leave room for 3 programs an SM), with one stage the sweep the same and RL
    # -8%: hence 64 (docs/design/engine-tuning.md).
    unsplit_tile = 64
    attention_warps = 4  # 2 warps or 3 stages: within 2% (docs/design/engine-tuning.md)
    attention_stages = 2
    # A decode attention program (RoPE inside) loads its first cached key/value tile before its
    # wait, and its second too where a tile is at most `attention_preload_max_bytes` and rows
    # are split in at most `attention_preload_max_splits` shares (more shares: a share of a
    # short row is one tile, the second would be empty and only cost registers). Decode step
    # measured on an H200, one tile -> two: 0.5B batch 256 1313 -> 1278 us, batch 64 882 -> 863
    # (3 shares of 32-token tiles), batch 16 790 -> 793 (9 shares); 1.5B batch 64 1694 -> 1656,
    # batch 16 1481 -> 1487, batch 256 2533 -> 2689 (its 16 KB tiles, 128-wide heads by 64
    # tokens, take the kernel from 128 to 152 registers a thread: 3 programs an SM instead of 4,
    # so its 512 programs no longer fit at once; docs/design/engine-tuning.md).
    attention_preload_max_bytes = 8 << 10
    attention_preload_max_splits = 4
    # A decode step's RoPE and key/value store inside the attention kernel (one kernel a layer fewer).
    fuse_rope = True
    # Products of at most `skinny_rows` rows (a small batch's decode step) whose weight is at most
    # `skinny_max_bytes` run as `_skinny_linear_kernel` (bf16 and fp16); the rest go to cuBLAS.
    # That kernel asks L2 for its weight while the kernel before it still runs, which pays where
    # a product is too small to reach the bandwidth: the attention's q/k/v and o products. On
    # the MLP's (9-55 MB) cuBLAS streams better. Measured on an H200, decode step at batch 16,
    # 0.5B shape: cuBLAS 983 us, all products skinny 997, those up to 8 MB 918, up to 10 MB 937;
    # 1.5B 1690, 2085, 1622. Past 16 rows the kernel takes row tiles of 32 or 64, and loses to
    # cuBLAS: q/k/v and o on it at every batch, 0.5B batch 256 1399 -> 1530 us, 1.5B batch 64
    # 1762 -> 1876; only 0.5B batch 64 gains (1000 -> 973). Hence 16 (docs/design/engine-tuning.md).
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
    # still runs. Measured on an H200, decode step: 0.5B batch 32 910 -> 827 us, batch 64 972 ->
    # 865, batch 128 1078 -> 1007, batch 256 1332 -> 1285; 1.5B batch 32 1630 -> 1571, batch 64
    # 1736 -> 1665, but batch 128 the same and batch 256 (4.7-6.3 MB weights) 2470 -> 2690, hence
    # the smaller bound past 64 rows, which leaves the 1.5B shape's products there to cuBLAS.
    # 64 x 64 tiles, or no L2 request, were within 1% at batch 256 and slower at 64; the MLP's
    # down product on it (k in 4 shares) gained nothing (docs/design/engine-tuning.md).
    tile_max_rows = 512
    tile_max_bytes = 8 << 20
    tile_wide_rows = 64
    tile_wide_max_bytes = 3 << 20
    tile_block = (64, 32, 128)  # BLOCK_M, BLOCK_N, BLOCK_K
    tile_warps = 4
    tile_stages = 3
    # Prefill attention of prompts up to this many tokens (the padded length) on
    # `prefill_attention.py`'s kernel, longer ones on SDPA's (cuDNN's) kernel. Measured on an
    # H200, SDPA -> this kernel, a call prefilling 256 prompts of 64 tokens: 0.5B 28.45 -> 27.38
    # ms, 1.5B 76.4 -> 76.0; of 128 tokens even (0.5B 50.9 -> 50.7, 1.5B 147.3 -> 148.5); 64 of
    # 512: 0.5B 50.6 -> 52.0, 1.5B 149.9 -> 153.9.
    prefill_kernel_max_len = 64
    # The products left to cuBLAS with more than `skinny_rows` rows and at most
    # `tune_max_rows` (the decode step's MLP and output embedding past 16 rows, and the
    # prefills captured as graphs) run on the fastest cuBLASLt algorithm that gives F.linear's
    # bits, where it beats F.linear by `tune_min_gain` timed alone (`cublaslt.choose`, once per
    # shape, at the eager run before a graph is captured). Measured on an H200 against F.linear,
    # alternating in one process: 0.5B batch 256 step 1244/1261 -> 1225/1234 us and its 256 x 64
    # prefill (1-token call) 24.9 -> 23.0-23.5 ms, batch 64 856-859 -> 849-852; 1.5B batch 64
    # 1625-1632 -> 1584-1592, batch 256 the same. Candidates with other bits, and configurations
    # beyond the heuristic's list, were no better in the step (docs/design/engine-tuning.md).
    tune_products = True
    tune_max_rows = 16384
    tune_min_gain = 0.03

    # Warps a program of the norm (a row), the sampling chunk kernel (sampling.CHUNK tokens) and
    # the SiLU (1024 columns). Measured on an H200, 0.5B decode step: norm 1, 2 or 4 and SiLU 1
    # or 4 within the spread at batch 256, SiLU 1 slower at 16 (794 -> 808 us); sampling 4
    # instead of 8 1283 -> 1270 us at batch 256, the same at 16, and on another H200 1282 -> 1277
    # at 256, the same at 64; the GPU tests pass with 4.
    norm_warps = 4
    sample_warps = 4
    silu_warps = 4
    silu_block = 1024  # columns a SiLU program takes (4096: 0.5B batch 256 1232-1237 -> 1260 us)

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
        self._products: dict[tuple, cublaslt.LtProduct | None] = {}  # `_cublas`' choices by shape
        self._tuning = False  # within `tuning`
        # Programmatic dependent launch (Hopper on): the kernels that wait for their predecessor
        # with `gdc_wait` (norm, RoPE, attention, skinny products) are launched so that they may
        # start before it ends; captured graphs keep that. With cuBLAS products alone it took the
        # H200 decode step from 1005 to 983 us (0.5B, batch 16) and 2671 to 2635 (1.5B, batch 256).
        if pdl is None:
            pdl = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
        self.pdl = pdl

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, block_size, num_splits):
        return self._attention(q, k_cache, v_cache, block_tables, seq_lens - 1, block_size, num_splits)

    def context_attention(self, q, k_cache, v_cache, block_tables, starts, lengths, block_size):
        # A prefill after a prefix-cache hit: the cached prefix read where it is, once per block of
        # query rows (torch's way gathers it into a dense copy first; one paged decode query per
        # suffix token read it once per token, slower than no cache at all on an H100).
        if q.stride(3) != 1 or q.stride(2) != q.shape[3]:
            q = q.contiguous()
        return extend_attention(q, k_cache, v_cache, block_tables, starts, lengths, block_size)

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
        # The kernel takes rows q.stride(0) apart (`qk_rope_cache`'s q is a view with the keys
        # between rows) and each row's heads packed, D apart.
        if (q.stride(-1) != 1 or (not rope and q.stride(1) != head_dim)):
            q = q.contiguous()
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
        return self._cublas(x, weight, bias)

    def output_linear(self, x, weight):
        return self._cublas(x, weight, None)

    @contextlib.contextmanager
    def tuning(self):
        self._tuning = True
        try:
            yield
        finally:
            self._tuning = False

    def _cublas(self, x, weight, bias):
        """F.linear, or the same bits from a faster cuBLASLt algorithm (`tune_products`), chosen
        for the shapes of captured graphs only (`tuning`): an eager prefill's shapes come once
        (a prefix-cache hit's suffixes, prompts past the graphs' budget), and tuning one takes
        tens of milliseconds, more than its products."""
        rows, k = x.shape
        if not (self.tune_products and self.skinny_rows < rows <= self.tune_max_rows and x.is_cuda
                and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
                and weight.is_contiguous() and x.stride(1) == 1 and (bias is None or bias.is_contiguous())):
            return F.linear(x, weight, bias)
        key = (x.device, x.dtype, rows, weight.shape[0], k, x.stride(0), bias is not None)
        if key not in self._products:
            if not self._tuning or torch.cuda.is_current_stream_capturing():
                return F.linear(x, weight, bias)  # chosen at the eager warm-up of a capture
            try:
                self._products[key] = cublaslt.choose(x, weight, bias, min_gain=self.tune_min_gain)
            except (OSError, ImportError, AttributeError, RuntimeError) as exc:  # no usable cuBLASLt here
                log.warning("cuBLASLt products off: tuning %s failed (%s); F.linear runs them", key[2:5], exc)
                self.tune_products = False
                return F.linear(x, weight, bias)
        product = self._products[key]
        if product is None:
            return F.linear(x, weight, bias)
        return product.run(x, weight, bias)

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
        block = self.silu_block
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
