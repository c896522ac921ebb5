"""A one-off experiment (2026-12-02) kept as the record behind the decode-attention tile choice:
RL-shaped calls (128 prompts x 8 samples, prompts of 64-512 tokens, up to 1024 new tokens) with
32- and 64-token tiles for unsplit rows, alternating in one process on one model. Each trial
drops the captured graphs first, so every trial pays the same captures; the first trial of each
shape also compiles its kernels and is slow for that reason.

    python bench/experiments/attention_tile_rl.py   # on a GPU; output: bench/results/attention_tile_rl-*.txt
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import _Ids, make_model  # noqa: E402
from services.rollout.builtin import kernels as K  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

TILE = {"n": 32}


def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, block_size, num_splits):
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    acc = torch.empty(batch, num_heads, num_splits, dim_pad, dtype=torch.float32, device=q.device)
    ml = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, num_heads * head_dim, dtype=q.dtype, device=q.device)
    block_n = TILE["n"] if num_splits == 1 else 32
    K._decode_attention_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, acc, ml, self._counter(q.device, batch * num_kv_heads),
        block_tables.stride(0), head_dim**-0.5, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2)
    return out


def main() -> None:
    K.TritonOps.decode_attention = decode_attention
    for shape in ("0.5b", "1.5b"):
        model = make_model(shape, torch.bfloat16, "cuda")
        vocab = model.config.vocab_size
        rng = random.Random(1)
        stops = tuple(rng.sample(range(vocab), vocab // 300))
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(64, 512))] for _ in range(128)]
        sampling = Sampling(temperature=1.0, max_new_tokens=1024, n=8, seed=3, stop_token_ids=stops)
        core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=256))
        for tile in (32, 64, 32, 64):
            TILE["n"] = tile
            if core.runner is not None:
                core.runner.drop_graphs()
            core.generate(prompts[:8], Sampling(temperature=1.0, max_new_tokens=64, n=8, seed=3, stop_token_ids=stops))
            torch.cuda.synchronize(); t = time.perf_counter()
            results = core.generate(prompts, sampling)
            torch.cuda.synchronize(); s = time.perf_counter() - t
            tokens = sum(len(r.output_ids) for r in results)
            st = core.scheduler.last_stats
            print(shape, "tile", tile, "tokens", tokens, "s", round(s, 3), "tok/s", round(tokens / s), "decode_s", round(st.decode_s, 3),
                  "prefill_s", round(st.prefill_s, 3), flush=True)
        del core, model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
