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
    """The commit measured: RLFLEET_COMMIT when set (a copy without .git), else git's."""
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


def two_ranks(argv: Callable[[int, int], list[str]], timeout_s: float = 600) -> str:
    """Run a measurement as two processes, rank 1 then rank 0, each started as `argv(rank, port)`
    with one free port for their store; returns rank 0's stdout, after both have exited cleanly."""
    from services.weights.broadcast import free_port

    port = free_port()
    peer = subprocess.Popen(argv(1, port))
    try:
        out = subprocess.run(argv(0, port), capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"rank 0 failed (exit {out.returncode}): {out.stderr[-2000:]}")
        peer_rc = peer.wait(timeout=60)
    finally:
        if peer.poll() is None:  # rank 0 failed or timed out: rank 1 would wait for it forever
            peer.kill()
            peer.wait()
    if peer_rc != 0:
        raise RuntimeError(f"rank 1 failed (exit {peer_rc}); its output is above")
    return out.stdout


def median_seconds(fn: Callable[[], None], repeats: int = 3, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_key(name: str) -> str:
    """A results file's machine part: `cpu`, `nvidia-h200`, `nvidia-h200-x2`, ... from `machine()`."""
    import re

    lower = name.lower()
    if lower.endswith(" cpu"):
        return "cpu"
    gpu = re.sub(r"[^a-z0-9]+", "-", lower.removeprefix("nvidia ").split(" x")[0])
    gpu = re.sub(r"-(\d+gb|hbm\w*|sxm\w*|pcie)\b", "", gpu).strip("-")
    count = re.search(r" x(\d+)$", lower)
    return f"nvidia-{gpu}" + (f"-x{count.group(1)}" if count and count.group(1) != "1" else "")


def publish(bench: str, run: Path, results: Path = Path(__file__).parent / "results") -> Path:
    """Make a finished run (its JSON lines in `run`) the current result of `bench` on its machine,
    `<bench>-<machine>.jsonl`, and append its lines to `history.jsonl`, every benchmark's runs in
    one file (each line names its `bench`)."""
    lines = [line for line in run.read_text().splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"{run}: no result lines")
    current = results / f"{bench}-{machine_key(json.loads(lines[0]).get('machine', machine()))}.jsonl"
    current.write_text("\n".join(lines) + "\n")
    named = [json.dumps({"bench": bench, **json.loads(line)}) for line in lines]
    with (results / "history.jsonl").open("a") as history:
        history.write("\n".join(named) + "\n")
    return current


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Publish a benchmark run as the current result, "
                                     "appended to the history: python bench/common.py publish BENCH RUN.jsonl")
    parser.add_argument("command", choices=["publish"])
    parser.add_argument("bench")
    parser.add_argument("run", type=Path)
    args = parser.parse_args()
    print(publish(args.bench, args.run))
