"""A screening experiment (2026-12-03): the gated MLP's first product at 256 rows (0.5B: x [256,
896] times gate/up [9728, 896]^T) as a CUDA C kernel whose CTAs share the activations' loads
through TMA multicast across a cluster, against cuBLAS (`F.linear`).

Why: at 256 rows cuBLAS takes ~10.8 us for this 17 MB product, bound by traffic through L2:
without sharing loads between SMs each SM's share of the output needs its rows of x and its
columns of the weight, ~65 MB through L2 in all (docs/rollout-engine.md). Here every CTA computes
all 256 rows for BN weight rows (one wave: 122 CTAs of 80 rows); the CTAs of a cluster of CL
each load 256/CL rows of x's k block and multicast them to all CL, so x crosses L2 122/CL times
instead of 122.

The kernel: one producer thread issues the TMA loads (128-byte swizzled tiles of 64 k) into
STAGES shared-memory slots, each with a "full" mbarrier (bytes landed) and an "empty" one (the
consumers of every CTA of the cluster done with it: the peers' multicasts write into this CTA's
slot, so a slot is free only when all of them have released it); two consumer warpgroups each
multiply 128 rows (two m64 wgmma blocks) by the BN weight rows. Launched with PDL: the producer
loads the first weight tiles before `griddepcontrol.wait`. k is summed in a fixed order: the
same bits every run. Built at run time with NVRTC, launched through the driver API (ctypes),
on torch's stream (so CUDA graphs capture it).

    python bench/experiments/cluster_gemm.py   # on a Hopper GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.hopper_gemm import ClusterGemm  # noqa: E402
from bench.experiments.tile_linear import COPIES, graph_us  # noqa: E402

def main() -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    read_us = graph_us([lambda: src.view(torch.int64).sum()])
    bandwidth = (1 << 30) / read_us / 1e6
    src = None  # the buffer freed
    print(f"# read bandwidth {bandwidth:.2f} TB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    plans = {  # (bn, stages, cluster, kind)
        "0.5b gate_up": (9728, 896, [(80, 4, 1, "wide"), (80, 4, 2, "wide"), (80, 4, 4, "wide"), (80, 5, 2, "wide"),
                                     (128, 4, 2, "wide")]),
        "0.5b down": (896, 4864, [(128, 4, 8, "down"), (128, 6, 8, "down"), (128, 4, 4, "down")]),
        "0.5b qkv": (1152, 896, [(16, 4, 2, "wide"), (32, 4, 2, "wide")]),
        "1.5b gate_up": (17920, 1536, [(136, 3, 2, "wide"), (136, 3, 4, "wide"), (128, 3, 2, "wide")]),
        "1.5b down": (1536, 8960, [(128, 4, 8, "down"), (128, 4, 4, "down")]),
    }
    for name, (n, k, variants) in plans.items():
        weights = [(torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(COPIES)]
        for rows in (256, 200):
            x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
            want = F.linear(x, weights[0])
            cublas = graph_us([lambda w=w: F.linear(x, w) for w in weights])
            line = [f"{name:13s} b{rows} weight at bandwidth {n * k * 2 / bandwidth / 1e6:5.1f} us  cublas {cublas:5.1f}"]
            for bn, stages, cl, kind in variants:
                try:
                    gemm = ClusterGemm(bn, stages, cl, kind)
                    got = gemm(x, weights[0])
                    torch.cuda.synchronize()
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    again = torch.equal(gemm(x, weights[0]), got)
                    out = torch.empty_like(want)
                    us = graph_us([lambda w=w: gemm(x, w, out) for w in weights])
                    line.append(f"{kind} bn{bn} s{stages} cl{cl} {us:5.1f} (err {err:.1e}{'' if again else ' NOT REPEATED'})")
                except Exception as exc:  # say what failed, go on
                    line.append(f"{kind} bn{bn} s{stages} cl{cl} failed: {type(exc).__name__}: {str(exc)[:300]}")
                print("  ".join(line), flush=True)
                line = ["   "]
        weights = None
    print("# done", flush=True)


if __name__ == "__main__":
    main()
