"""Job metrics on disk: JSON lines per RL step and per eval, and the reward-curve plot.

A job's output directory holds `metrics.jsonl` (one `{"step", "time", "metrics"}` line per RL
step) and `eval.jsonl` (one `{"step", "time", "dataset", "metrics"}` line per dataset per eval
point). Lines are appended and flushed as they happen, so a crashed or still-running job
leaves readable files and `read_jsonl` skips a torn last line. `plot_rewards` turns both into
`reward_curve.png` with matplotlib's Agg canvas (no pyplot, no global backend switch).
"""

from __future__ import annotations

import json
import math
import os
import time as _time
from pathlib import Path
from typing import Any, Mapping

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
PLOT_FILE = "reward_curve.png"
TRAIN_REWARD_KEY = "reward_mean"  # the coordinator's per-step mean reward
EVAL_SCORE_KEY = "score"  # the mean reward over one eval dataset


class MetricsWriter:
    """Appends step and eval records to the JSON-lines files of one output directory."""

    def __init__(self, output_dir: str | Path) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)

    def write_step(self, step: int, metrics: Mapping[str, Any], *, time: float | None = None) -> None:
        self._append(METRICS_FILE, {"step": step, "time": _now(time), "metrics": _plain(dict(metrics))})

    def write_eval(self, step: int, metrics: Mapping[str, Any], *, time: float | None = None) -> None:
        """One eval result; a "dataset" entry in metrics becomes the record's dataset label."""
        values = dict(metrics)
        dataset = values.pop("dataset", None)
        record = {"step": step, "time": _now(time), "dataset": dataset, "metrics": _plain(values)}
        self._append(EVAL_FILE, record)

    def drop_after(self, step: int) -> None:
        """Remove the records of steps after `step` (a job resumed from that step's checkpoint
        writes them again)."""
        for name in (METRICS_FILE, EVAL_FILE):
            path = self.output_dir / name
            kept = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
            if path.exists():
                path.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept), encoding="utf-8")

    def _append(self, name: str, record: dict[str, Any]) -> None:
        line = json.dumps(record, allow_nan=False) + "\n"
        with (self.output_dir / name).open("a", encoding="utf-8") as f:
            f.write(line)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics file; [] when it does not exist; a torn (unparsable) line is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a writer killed mid-line; everything else is still good
    return records


def _now(time: float | None) -> float:
    return _time.time() if time is None else time


def _plain(value: Any) -> Any:
    """JSON-safe data: tensors and numpy scalars become numbers, NaN and infinities become null."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"metrics: {type(value).__name__} {value!r} is not JSON data")


def plot_rewards(
    output_dir: str | Path,
    *,
    train_key: str = TRAIN_REWARD_KEY,
    eval_key: str = EVAL_SCORE_KEY,
    title: str | None = None,
) -> Path:
    """Draw the train reward per step and every eval dataset's score into reward_curve.png."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # imported here: ~0.5 s, only for plots
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    output_dir = Path(output_dir)
    train = [
        (r["step"], r["metrics"][train_key])
        for r in read_jsonl(output_dir / METRICS_FILE)
        if isinstance(r.get("metrics", {}).get(train_key), int | float)
    ]
    evals: dict[str, list[tuple[int, float]]] = {}
    for r in read_jsonl(output_dir / EVAL_FILE):
        score = r.get("metrics", {}).get(eval_key)
        if isinstance(score, int | float):
            evals.setdefault(str(r.get("dataset") or "eval"), []).append((r["step"], score))

    fig = Figure(figsize=(8, 4.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = iter(["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"])
    if train:
        steps, values = zip(*sorted(train))
        colour = next(colours)
        if len(values) >= 20:
            window = max(2, len(values) // 15)
            ax.plot(steps, values, color=colour, alpha=0.25, linewidth=1, label="train reward (per step)")
            ax.plot(steps, _moving_average(values, window), color=colour, linewidth=2.2,
                    label=f"train reward ({window}-step average)")
        else:
            ax.plot(steps, values, color=colour, linewidth=2, marker=".", label="train reward")
    for name, points in sorted(evals.items()):
        steps, values = zip(*sorted(points))
        ax.plot(steps, values, color=next(colours, None), linewidth=1.8, marker="o", markersize=5,
                label=f"eval: {name}")
    if not train and not evals:
        ax.text(0.5, 0.5, "no metrics recorded yet", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_title(title or f"{output_dir.name}: reward", fontsize=12)
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, even in a 3-step run
    ax.grid(True, alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    if train or evals:
        ax.legend(frameon=False, loc="best")
    path = output_dir / PLOT_FILE
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)  # a reader (REST, a browser refresh) never sees half a PNG
    return path


def _moving_average(values: tuple[float, ...], window: int) -> list[float]:
    """Trailing mean over up to `window` points (shorter at the start, so the curve starts at step one)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
