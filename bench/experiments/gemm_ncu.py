"""A one-off experiment (2026-12-03, session 22): why session 20's CUDA C product kernel
(`hopper_gemm.ClusterGemm`, TMA into a ring of mbarrier slots, two wgmma consumer warpgroups)
takes 17 us for the 0.5B gate/up product at 256 rows where cuBLAS takes 10.7: both launched once
between cudaProfilerStart and Stop, for Nsight Compute to compare their memory traffic and warp
stalls. The order of launches is printed.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \
        --section Occupancy python3 bench/experiments/gemm_ncu.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.hopper_gemm import ClusterGemm  # noqa: E402


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 896, generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn(9728, 896, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    cases = {"cublas gate_up": lambda: F.linear(x, w)}
    for bn, stages, cl in ((80, 4, 1), (80, 4, 2)):
        gemm = ClusterGemm(bn, stages, cl, "wide")
        out = torch.empty(256, 9728, dtype=torch.bfloat16, device="cuda")
        cases[f"cuda-c gate_up bn{bn} s{stages} cl{cl}"] = lambda gemm=gemm, out=out: gemm(x, w, out)
    for fn in cases.values():  # warm: compile, load, first launches outside the profiled range
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, fn in cases.items():
        print(f"# launch: {name}", flush=True)
        fn()
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
