"""Metrics files and the reward-curve plot."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from services.coordinator.metrics import EVAL_FILE, METRICS_FILE, MetricsWriter, plot_rewards, read_jsonl

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_writer_appends_one_json_line_per_step_and_eval(tmp_path):
    out = tmp_path / "run"
    writer = MetricsWriter(out)  # creates the directory
    writer.write_step(1, {"reward_mean": 0.25, "loss": torch.tensor(1.5), "note": "warmup"}, time=100.0)
    writer.write_step(2, {"reward_mean": 0.5, "grad_norm": float("nan")}, time=101.0)
    writer.write_eval(2, {"dataset": "heldout", "score": 0.75, "num_prompts": 4}, time=102.0)

    lines = (out / METRICS_FILE).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "time": 100.0, "metrics": {"reward_mean": 0.25, "loss": 1.5, "note": "warmup"}},
        {"step": 2, "time": 101.0, "metrics": {"reward_mean": 0.5, "grad_norm": None}},  # NaN is not JSON
    ]
    assert read_jsonl(out / EVAL_FILE) == [
        {"step": 2, "time": 102.0, "dataset": "heldout", "metrics": {"score": 0.75, "num_prompts": 4}}
    ]


def test_writer_stamps_the_current_time(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write_step(1, {"x": 1})
    assert math.isclose(read_jsonl(tmp_path / METRICS_FILE)[0]["time"], __import__("time").time(), abs_tol=60)


def test_writer_rejects_values_that_are_not_json_data(tmp_path):
    with pytest.raises(TypeError, match="not JSON data"):
        MetricsWriter(tmp_path).write_step(1, {"x": object()})


def test_read_jsonl_skips_a_torn_last_line(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "metrics": {}}\n{"step": 2, "metr')
    assert read_jsonl(path) == [{"step": 1, "metrics": {}}]
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_plot_rewards_writes_a_png(tmp_path):
    writer = MetricsWriter(tmp_path)
    for step in range(1, 41):
        writer.write_step(step, {"reward_mean": 1 - math.exp(-step / 10)})
    for step in (0, 20, 40):
        writer.write_eval(step, {"dataset": "heldout", "score": step / 50})
        writer.write_eval(step, {"dataset": "ood", "score": step / 80})

    path = plot_rewards(tmp_path)
    assert path == tmp_path / "reward_curve.png"
    data = path.read_bytes()
    width, height = png_size(data)
    assert (width, height) == (960, 540)  # 8 x 4.5 inches at 120 dpi
    assert len(data) > 10_000  # curves, legend and labels, not a blank canvas
    assert not list(tmp_path.glob("*.tmp.png"))


@pytest.mark.parametrize("which", ["train only", "eval only", "nothing"])
def test_plot_rewards_handles_partial_data(tmp_path, which):
    writer = MetricsWriter(tmp_path)
    if which == "train only":
        writer.write_step(1, {"reward_mean": 0.5})
        writer.write_step(2, {"reward_mean": None})  # a step without a reward is skipped
    if which == "eval only":  # an eval-only job: one point per dataset
        writer.write_eval(0, {"dataset": "heldout", "score": 0.4})
    path = plot_rewards(tmp_path, title="custom title")
    assert png_size(path.read_bytes())[0] > 0
