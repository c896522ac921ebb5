"""Shared bits of the benchmarks: the JSON-line record every benchmark prints, with date, commit
and machine, and a timer that takes the median of repeated runs."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable


def commit() -> str:
    """The commit measured: RLFLEET_COMMIT when set (the device machine gets no .git), else git's."""
    if os.environ.get("RLFLEET_COMMIT"):
        return os.environ["RLFLEET_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    return f"{platform.processor() or platform.machine()} cpu"


def record(metric: str, gbps: float, limit_gbps: float, **extra) -> dict:
    return {
        "metric": metric,
        "gbps": round(gbps, 3),
        "limit_gbps": round(limit_gbps, 3),
        "ratio": round(gbps / limit_gbps, 3) if limit_gbps else None,
        **extra,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit(),
        "machine": machine(),
    }


def emit(line: dict, out: Path | None = None) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(text + "\n")


def median_seconds(fn: Callable[[], None], repeats: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
