"""Asynchronous RL against synchronous: the same job run both ways, one after the other, in one invocation.

Each job runs through `rlfleet run` (its own local trainer, engine and coordinator processes).
Reported for each: wall time, held-out accuracy before and after, the sum of its phases
(generate, train, sync), and for the asynchronous one the trainer's idle fraction and the
staleness of what it trained on. The limit is the higher of two floors under the asynchronous
wall time, both from the synchronous run: perfect overlap of its phases (its wall time less the
work the trainer could hide: min(generate + reward + the evals between steps, train + sync), as
the producer generates and scores while the trainer trains and an eval runs beside the next
step), and the share of the machine's
cores it kept busy (`cores_busy`: its processes' CPU seconds from its first eval to its last step
over the cores and that time: overlapped phases share the cores, so the same work cannot take
less); `speedup_ratio` is the speedup measured over that limit's.

    python bench/async.py --out run.jsonl --png bench/results/async-<machine>.png && python bench/common.py publish async run.jsonl
    python bench/async.py --steps 40    # a shorter pair
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import commit, emit, machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
JOBS = [ROOT / "examples/arith/job.yaml", ROOT / "examples/arith/async.yaml"]


def _absolute(config: dict, base: Path) -> dict:
    """The job's relative paths (model, data, eval sets) resolved against its own folder."""
    def resolve(value):
        return str((base / value).resolve()) if isinstance(value, str) and not Path(value).is_absolute() else value

    config["model"] = resolve(config["model"])
    config["data"] = {**config["data"], "train": resolve(config["data"]["train"])}
    for dataset in config.get("eval", {}).get("datasets", []):
        dataset["path"] = resolve(dataset["path"])
    return config


def _cpu_samples(child: subprocess.Popen, every: float = 0.2) -> list[tuple[float, float]]:
    """(time, CPU seconds so far of `child` and every process under it) every `every` seconds
    until it exits (a process that exits drops out of the sum: the job's services live to its end)."""
    tick = os.sysconf("SC_CLK_TCK")
    samples = []
    while child.poll() is None:
        parents, used = {}, {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rpartition(")")[2].split()
                except OSError:
                    continue
                parents[int(entry.name)] = int(fields[1])
                used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick

        def under(pid: int) -> bool:
            while pid > 1:
                if pid == child.pid:
                    return True
                pid = parents.get(pid, 0)
            return False

        samples.append((time.time(), sum(t for pid, t in used.items() if under(pid))))
        time.sleep(every)
    return samples


def _cpu_at(samples: list[tuple[float, float]], when: float) -> float:
    """CPU seconds at `when`, between the samples around it."""
    for (t0, c0), (t1, c1) in zip(samples, samples[1:]):
        if t0 <= when <= t1:
            return c0 + (c1 - c0) * (when - t0) / max(t1 - t0, 1e-9)
    return samples[-1][1] if samples and when > samples[-1][0] else (samples[0][1] if samples else 0.0)


def run_job(path: Path, steps: int | None, work: Path) -> dict:
    config = _absolute(yaml.safe_load(path.read_text()), path.parent)
    if steps is not None:
        config["num_rollout"] = steps
        config.setdefault("eval", {})["every"] = 0
    job = work / path.name
    job.write_text(yaml.safe_dump(config))
    out = work / f"{path.stem}-out"
    with open(work / f"{path.stem}.log", "w+") as log:
        child = subprocess.Popen([sys.executable, "-m", "services.cli", "run", str(job), "--output-dir", str(out),
                                  "--no-progress"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        cpu = _cpu_samples(child)
        log.seek(0)
        done = subprocess.CompletedProcess(child.args, child.returncode, log.read(), "")
    if done.returncode != 0:
        raise RuntimeError(f"{path.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r["metrics"] for r in records]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    phase = {k: round(sum(m.get(k, 0.0) for m in steps_), 2) for k in ("generate_s", "reward_s", "train_s", "sync_s")}
    # the evals between steps (not the one before training, nor the one after the last step)
    phase["between_evals_s"] = round(sum(e["metrics"]["seconds"] for e in evals
                                         if 0 < e["step"] < summary["steps"]), 2)
    # The share of the machine's cores the job kept busy from its first eval to its last step.
    start = evals[0]["time"]
    end = max([e["time"] for e in evals] + [r["time"] for r in records])
    busy = (_cpu_at(cpu, end) - _cpu_at(cpu, start)) / max(end - start, 1e-9) / len(os.sched_getaffinity(0))
    line = {
        "job": path.name, "asynchronous": bool(config.get("algorithm", {}).get("async")), "steps": summary["steps"],
        "wall_s": round(summary["wall_s"], 2), "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"], **phase,
        "cores_busy": round(busy, 3),
        "evals": [(e["step"], round(e["time"] - evals[0]["time"], 2), e["metrics"]["score"]) for e in evals],
    }
    if line["asynchronous"]:
        n = max(len(steps_), 1)
        line.update({
            "trainer_idle_frac": round(sum(m["trainer_idle_frac"] for m in steps_) / n, 3),
            "engine_idle_frac": round(sum(m["engine_idle_frac"] for m in steps_) / n, 3),
            "staleness_mean": round(sum(m["staleness_mean"] for m in steps_) / n, 3),
            "staleness_max": max(m["staleness_max"] for m in steps_),
            "samples_dropped": sum(m["samples_dropped"] for m in steps_),
            "samples_mixed_frac": round(sum(m["samples_mixed_frac"] for m in steps_) / n, 3),
        })
    return line


def plot(lines: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for line in lines:
        label = f"{'async' if line['asynchronous'] else 'sync'} ({line['wall_s']:.0f} s)"
        ax.plot([t for _, t, _ in line["evals"]], [s for _, _, s in line["evals"]], "o-", label=label)
    ax.set(xlabel="seconds since the first eval", ylabel="held-out accuracy")
    ax.set_title(f"asynchronous RL against synchronous ({lines[0]['machine']}, {lines[0]['commit']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=Path, nargs=2, default=JOBS, metavar=("SYNC", "ASYNC"))
    parser.add_argument("--steps", type=int, help="instead of the jobs' num_rollout (and no eval between)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    lines = []
    with tempfile.TemporaryDirectory(prefix="rlfleet-async-") as work:
        for i, job in enumerate(args.jobs):
            print(f"# [{i + 1}/2] {job.name} ...", file=sys.stderr, flush=True)
            line = run_job(job, args.steps, Path(work))
            print(f"#   {line['wall_s']} s, accuracy {line['eval_before']} -> {line['eval_after']}", file=sys.stderr,
                  flush=True)
            lines.append(line)
    sync, async_ = lines
    hidden = min(sync["generate_s"] + sync["reward_s"] + sync["between_evals_s"], sync["train_s"] + sync["sync_s"])
    # Two floors under the asynchronous wall time: the synchronous run less the producer's work
    # and the evals the trainer could hide, and the share of the cores it kept busy (overlapped
    # phases share them).
    overlap_floor = sync["wall_s"] - hidden
    cpu_floor = sync["wall_s"] * sync["cores_busy"]
    limit = sync["wall_s"] / max(overlap_floor, cpu_floor, 1e-9)
    speedup = sync["wall_s"] / async_["wall_s"]
    for line in lines:
        line.update({"bench": "async", "speedup": round(speedup, 3), "limit_speedup": round(limit, 3),
                     "speedup_ratio": round((speedup - 1) / (limit - 1), 3) if limit > 1 else None,
                     "wall_ratio": round(async_["wall_s"] / sync["wall_s"], 3),
                     "overlap_floor_ratio": round(overlap_floor / sync["wall_s"], 3),
                     "cpu_floor_ratio": round(cpu_floor / sync["wall_s"], 3), "cores": len(os.sched_getaffinity(0)),
                     "accuracy_delta": round(async_["eval_after"] - sync["eval_after"], 3),
                     "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine()})
        emit(line, args.out)
    print(f"# async wall {async_['wall_s']} s = {lines[0]['wall_ratio']} x sync {sync['wall_s']} s "
          f"(floors: perfect overlap {overlap_floor / sync['wall_s']:.3f} x, busy cores of {len(os.sched_getaffinity(0))} "
          f"{cpu_floor / sync['wall_s']:.3f} x); accuracy {async_['eval_after']} vs {sync['eval_after']}",
          file=sys.stderr, flush=True)
    if args.png:
        plot(lines, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
