"""A one-off experiment (2026-12-02): the decode attention kernel alone (RoPE and the key/value
store inside), at the sweep's shapes (0.5B and 1.5B heads, 256 or 16 rows of 128 cached tokens,
blocks in shuffled order as a long-running cache holds them), for Nsight Compute to say where its
time goes. Only the launches between cudaProfilerStart and Stop are profiled; the order is printed.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section MemoryWorkloadAnalysis python3 bench/experiments/attention_ncu.py

Not yet run, and the next thing to ask: which source lines the warps stall on (Triton keeps line
information), e.g. `ncu --set full --import-source yes --page source --print-source sass ...`.
Compiled for sm_90 off the device (aligned pointers, as the JIT specialises them) the RoPE
variant at 64-token tiles is 1368 SASS instructions, 624 without RoPE (that one's first tile
is not peeled out of the loop), at 80 registers: the RoPE work, a [1, D] key tile and layout
conversions are a large share of the chain after the wait.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.rollout.builtin.kernels import TritonOps  # noqa: E402
from services.rollout.builtin.ops import rope_table  # noqa: E402

SHAPES = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128)}  # heads, KV heads, head dim
BLOCK = 16


def main() -> None:
    torch.manual_seed(0)
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for rows, splits in ((256, 1), (16, 9)):
            length = 128
            blocks_per_row = 1536 // BLOCK
            num_blocks = rows * blocks_per_row + 1
            k_cache = torch.randn(num_blocks * BLOCK, kv_heads, dim, **bf16)
            v_cache = torch.randn(num_blocks * BLOCK, kv_heads, dim, **bf16)
            tables = (torch.randperm(num_blocks - 1, device="cuda")[: rows * blocks_per_row] + 1).view(rows, -1)
            tables = tables.to(torch.int32)
            seq_lens = torch.full((rows,), length, dtype=torch.int32, device="cuda")
            positions = seq_lens - 1
            qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, **bf16)
            q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
            table = rope_table(dim, 1e6, 4096, torch.device("cuda"))
            variants = {}
            # (The recorded run also had "pf128", a knob of commit 1dbc3b3 only.)
            for name, knobs in (("base", {}), ("tile32", dict(unsplit_tile=32)), ("tile128", dict(unsplit_tile=128))):
                ops = TritonOps()
                for knob, value in knobs.items():
                    setattr(ops, knob, value)
                variants[name] = (lambda ops=ops: ops.rope_decode_attention(
                    q, k, v, None, None, 1e-6, table, positions, k_cache, v_cache, tables, BLOCK, splits))
            for fn in variants.values():
                fn()
                fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for name, fn in variants.items():
                print(f"{shape} rows {rows} splits {splits}: {name}", flush=True)
                fn()
                torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
