"""Experiment (2026-12-03, session 27): how steady is the sweep's roofline denominator, the
streaming read bandwidth? `bench/rollout.py` takes the median of 5 sums over 4 GB (after one),
timed on the host around a synchronize. Across session 26-27's sweeps it read 3.92-4.14 TB/s on
different machines while the engine's tokens/s stayed at 182-184k, so the ratio moved 0.238-0.252
with the machine's reading. Here the same measure against longer warm-ups, CUDA events, and a
read-only Triton kernel, in one process, each several times.

    python bench/experiments/bandwidth.py   # on a GPU
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.read_kernel import read_sum  # noqa: E402
from bench.rollout import read_bandwidth  # noqa: E402

NBYTES = 4 << 30


def clocks() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def events(fn, n: int) -> list[float]:
    """Seconds of each of n calls of fn, by CUDA events."""
    times = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def host(fn, n: int) -> list[float]:
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def tb(seconds: float) -> float:
    return NBYTES / seconds / 1e12


def main() -> None:
    print(f"# clocks at start (sm, mem, power, temp): {clocks()}", flush=True)
    for round_ in range(3):
        print(f"# round {round_}: bench/rollout.py's read_bandwidth {read_bandwidth('cuda') / 1e12:.3f} TB/s "
              f"(as of the working tree this ran on)", flush=True)
    x = torch.ones(NBYTES // 2, dtype=torch.bfloat16, device="cuda")
    kernel = read_sum(x)  # (the results of 38889b4's run came from the same kernel, then written here)
    y = torch.empty_like(x)
    for round_ in range(3):
        warm_end = time.perf_counter() + 1.0
        while time.perf_counter() < warm_end:  # a second of sums: clocks up
            x.sum()
        torch.cuda.synchronize()
        s_host = sorted(host(x.sum, 30))
        s_event = sorted(events(x.sum, 30))
        k_event = sorted(events(kernel, 30))
        copy = sorted(events(lambda: y.copy_(x), 30))
        print(f"round {round_}: torch sum host-timed median {tb(s_host[15]):.3f} best {tb(s_host[0]):.3f} | "
              f"events median {tb(s_event[15]):.3f} best {tb(s_event[0]):.3f} | read kernel events median "
              f"{tb(k_event[15]):.3f} best {tb(k_event[0]):.3f} | copy (read + write) median "
              f"{2 * tb(copy[15]):.3f} TB/s   clocks {clocks()}", flush=True)


if __name__ == "__main__":
    main()
