"""A one-off experiment (2026-12-02; its kernels and knobs exist at commit 0f8ca4c only,
so run it there): the MLP products of a decode step (gate/up, SiLU, down) and
the attention's (q/k/v, o), one kernel at a time, cuBLAS against `_skinny_linear_kernel`, for
Nsight Compute to say where each kernel's time goes (stalls, bytes, occupancy). Only the launches
between cudaProfilerStart and Stop are profiled; the order is printed.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight ... \
        python3 bench/experiments/mlp_ncu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.rollout.builtin.kernels import TritonOps  # noqa: E402

SHAPES = {"0.5b": (896, 4864, 1152), "1.5b": (1536, 8960, 2048)}  # hidden, intermediate, q/k/v width


def with_knobs(ops: TritonOps, tma: bool, fn):
    def run():
        ops.skinny_tma = ops.gated_tma = tma
        return fn()
    return run


def main() -> None:
    torch.manual_seed(0)
    ops = TritonOps()
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    for shape, (hidden, inter, qkv) in SHAPES.items():
        w_qkv = torch.randn(qkv, hidden, **bf16) * 0.02
        w_o = torch.randn(hidden, hidden, **bf16) * 0.02
        w_gu = torch.randn(2 * inter, hidden, **bf16) * 0.02
        w_down = torch.randn(hidden, inter, **bf16) * 0.02
        for rows in (16, 256):
            x = torch.randn(rows, hidden, **bf16)
            gu = torch.randn(rows, 2 * inter, **bf16)
            act = torch.randn(rows, inter, **bf16)
            cases = {
                "cublas qkv": lambda: F.linear(x, w_qkv),
                "cublas o": lambda: F.linear(x, w_o),
                "cublas gate_up": lambda: F.linear(x, w_gu),
                "silu_mul": lambda: ops.silu_mul(gu[:, :inter], gu[:, inter:]),
                "cublas down": lambda: F.linear(act, w_down),
            }
            if rows <= 16:
                for tma in (False, True):
                    tag = " tma" if tma else ""
                    cases.update({
                        f"skinny{tag} qkv": with_knobs(ops, tma, lambda: ops._skinny_linear(x, w_qkv, None, silu=False)),
                        f"skinny{tag} o": with_knobs(ops, tma, lambda: ops._skinny_linear(x, w_o, None, silu=False)),
                        f"skinny{tag} gate_up": with_knobs(ops, tma, lambda: ops._skinny_linear(x, w_gu, None, silu=False)),
                        f"skinny{tag} down": with_knobs(ops, tma, lambda: ops._skinny_linear(act, w_down, None, silu=False)),
                        f"gated{tag}": with_knobs(ops, tma, lambda: ops.gated_up(x, w_gu)),
                    })
                cases["skinny down+silu"] = with_knobs(
                    ops, False, lambda: ops._skinny_linear(gu[:, :inter], w_down, None, silu=True))
            for fn in cases.values():
                fn()
                fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for name, fn in cases.items():
                print(f"{shape} rows {rows}: {name}", flush=True)
                fn()
                torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
