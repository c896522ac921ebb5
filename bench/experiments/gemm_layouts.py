"""A one-off screening experiment (2026-12-02): the decode step's cuBLAS products alone, at batch
16, 64 and 256, asked of cuBLAS in other ways, to see whether any picks a faster kernel:
- "linear": F.linear(x, w), as the engine calls it (cuBLAS sees m = n_out, n = batch);
- "swapped": torch.mm(w, x.t()), the transposed product (m = batch, n = n_out), whose output
  a consumer would read transposed;
- "fp32 reduce": F.linear with bf16 reduced-precision split-K reductions disallowed;
- "cublaslt": F.linear with cuBLASLt as torch's preferred library.
Each product is timed as a CUDA graph of 20 back-to-back calls (median of 5 replays), with the
streaming read bandwidth of the same run for scale.

    python bench/experiments/gemm_layouts.py   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.rollout.builtin import cublaslt  # noqa: E402

SHAPES = {  # name: (n_out, k)
    "0.5b qkv": (1152, 896), "0.5b o": (896, 896), "0.5b gate_up": (9728, 896), "0.5b down": (896, 4864),
    "1.5b qkv": (2048, 1536), "1.5b o": (1536, 1536), "1.5b gate_up": (17920, 1536), "1.5b down": (1536, 8960),
}
CALLS = 20


def graph_us(fn) -> float:
    """Microseconds a call of fn, CALLS of them back to back in a CUDA graph (the engine's timing)."""
    return cublaslt.graph_us(lambda i: fn(), CALLS)


def variant(name: str, x: torch.Tensor, w: torch.Tensor):
    if name == "swapped":
        return lambda: torch.mm(w, x.t())
    return lambda: F.linear(x, w)


def main() -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    read_us = graph_us(lambda: src.view(torch.int64).sum())
    print(f"# read bandwidth {(1 << 30) / read_us / 1e6:.2f} TB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
        for rows in (16, 64, 256):
            x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
            line = {}
            for v in ("linear", "swapped", "fp32 reduce", "cublaslt"):
                torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = v != "fp32 reduce"
                torch.backends.cuda.preferred_blas_library("cublaslt" if v == "cublaslt" else "cublas")
                line[v] = graph_us(variant(v, x, w))
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
            torch.backends.cuda.preferred_blas_library("cublas")
            weight_us = n * k * 2 / ((1 << 30) / read_us)
            print(f"{name:13s} b{rows:<4d} weight at bandwidth {weight_us:5.1f} us  "
                  + "  ".join(f"{v} {t:6.1f}" for v, t in line.items()), flush=True)


if __name__ == "__main__":
    main()
