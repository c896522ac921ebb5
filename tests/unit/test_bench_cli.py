"""Every benchmark still runs: `--help` for each, and a small CPU run of each that has a CPU mode
(its JSON lines stamped with commit and machine; `sync_phases`, a diagnostic, prints a timing
per sync instead); the GPU-only ones say so and exit 2."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in ("__init__", "common", "read_kernel"))
GPU_ONLY = ("decode_kernels", "host_upload", "sleep_wake", "train_step")
CPU_RUNS = {
    "rollout": ["--device", "cpu", "--shapes", "tiny", "--batches", "2", "--new-tokens", "4", "--repeats", "1",
                "--parts", "sweep", "--no-profile"],
    "serve": ["--clients", "2", "--seconds", "1", "--warmup", "0.5", "--new-tokens", "4"],
    "prefix": ["--conversations", "4", "--history", "64", "--reply", "4", "--turn", "8", "--repeats", "1"],
    "sync_phases": ["--mb", "4", "--syncs", "1", "--planes", "grpc_stream", "--log-lines", "0"],
    "weight_sync": ["--mb", "4", "--repeats", "1", "--planes", "shm", "--device", "cpu", "--json"],
    "parity": ["--device", "cpu", "--archs", "qwen3", "--head-dims", "48", "--batches", "1"],
    "async": ["--steps", "2"],
    "frontend": ["--clients", "4", "--seconds", "1", "--new-tokens", "4"],
    "fleet_scale": ["--engines", "1,2", "--steps", "1", "--train-ms", "50", "--new-tokens", "4", "--processes", "1"],
}
# Run as users run them elsewhere: verify_floor by tests/integration/test_bench_verify_floor.py;
# load's `run` by serve here and by tests/integration/test_starvation.py.
COVERED_ELSEWHERE = ("verify_floor", "load")


def _run(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_every_benchmark_is_covered_here():
    assert set(BENCHES) == set(GPU_ONLY) | set(CPU_RUNS) | set(COVERED_ELSEWHERE)


@pytest.mark.parametrize("name", BENCHES)
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(f"bench.{name}").main(["--help"])
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(CPU_RUNS))
def test_cpu_mode_runs_and_reports(name, tmp_path):
    out = _run(name, *CPU_RUNS[name])
    assert out.returncode == 0, out.stderr[-3000:]
    if name == "sync_phases":
        assert "grpc_stream sync 0:" in out.stdout and " ms (" in out.stdout, out.stdout[-2000:]
        return
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stdout[-2000:]
    assert all("commit" in line and "machine" in line for line in lines)


def test_serve_in_process_profiles_the_serving_thread(tmp_path):
    out = _run("serve", "--clients", "2", "--seconds", "1", "--warmup", "0.5", "--new-tokens", "4", "--in-process",
               "--profile-serving", str(tmp_path / "prof"))
    assert out.returncode == 0, out.stderr[-3000:]
    [line] = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert line["in_process"] and line["calls"] > 0 and 0 < line["serving_cpu_share"] <= 1.0, line
    profile = (tmp_path / "prof" / "serving-c2.txt").read_text()
    assert "Scheduler.round" in profile or "scheduler.py" in profile  # the serving thread's own calls


@pytest.mark.parametrize("name", GPU_ONLY)
def test_gpu_only_benchmarks_say_what_they_need(name, capsys):
    assert importlib.import_module(f"bench.{name}").main([]) == 2
    assert "needs a CUDA" in capsys.readouterr().err


def test_publish_makes_a_run_current_and_appends_it_to_the_history(tmp_path):
    from bench.common import publish

    results = tmp_path / "results"
    results.mkdir()
    for n in (1, 2):
        run = tmp_path / f"run{n}.jsonl"
        run.write_text(json.dumps({"metric": "x", "ratio": n / 10, "machine": "NVIDIA H200 x1", "commit": f"c{n}"}) + "\n")
        current = publish("demo", run, results)
    assert current.name == "demo-nvidia-h200.jsonl"
    assert json.loads(current.read_text())["commit"] == "c2"  # the newest run only
    history = [json.loads(line) for line in (results / "history.jsonl").read_text().splitlines()]
    assert [(h["bench"], h["commit"]) for h in history] == [("demo", "c1"), ("demo", "c2")]
