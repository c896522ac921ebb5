"""Asynchronous RL on GPUs, through `rlfleet run`: on one GPU the trainer and the engine are both
resident on it (no colocation, no offload); with two, the trainer has GPU 0 and the engine GPU 1,
the placement where generation and training overlap without sharing a device. In both, no trained
sample is more than max_staleness versions old; on two GPUs the engine generates each step while
the trainer trains the one before (its generation starts under the weights two versions back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith"
TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
STEPS = 8


@pytest.mark.parametrize(("trainer_device", "engine_devices"), [
    pytest.param("cuda", "[]", id="one-gpu"),
    pytest.param("cuda:0", "[cuda:1]", id="two-gpus", marks=TWO_GPUS),
])
def test_an_asynchronous_job_trains_within_its_staleness_on_gpus(tmp_path, trainer_device, engine_devices):
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        name: async-gpu
        seed: 1
        model: {EXAMPLE / 'model'}
        num_rollout: {STEPS}
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 32, samples_per_prompt: 8, sampling: {{max_new_tokens: 5}}, devices: {engine_devices}}}
        data: {{train: {EXAMPLE / 'data' / 'train.jsonl'}}}
        eval: {{every: 4, datasets: [{{name: heldout, path: {EXAMPLE / 'data' / 'test.jsonl'}, limit: 200, sampling: {{temperature: 0.0, max_new_tokens: 5}}}}]}}
        algorithm: {{advantage: grpo, async: {{max_staleness: 1, correction: tis, tis_cap: 2.0}}}}
        trainer: {{device: {trainer_device}, micro_batch_size: 256, optimizer: {{lr: 1.0e-4}}}}
        weight_sync: {{verify: fingerprint}}
        """))
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(job), "--no-progress", "--summary", str(tmp_path / "summary.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = {s["step"]: s["metrics"] for s in map(json.loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines())}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, m in steps.items():
        assert m["staleness_max"] <= 1 and m["samples_dropped"] == 0, (step, m)
        assert m["generated_version"] >= step - 2  # the gate: never more than one version behind
    # the engine ran ahead of the trainer: steps trained on samples of the weights one version back
    assert any(m["staleness_max"] == 1 for m in steps.values())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["eval_before"] > 0.2  # the example's weights reached the engine
    if engine_devices != "[]":
        # On its own GPU the engine starts step s while the trainer trains step s - 1: under the
        # weights of step s - 2, for most steps after the first two.
        ahead = [s for s in range(3, STEPS + 1) if steps[s]["generated_version"] == s - 2]
        assert len(ahead) >= (STEPS - 2) // 2, {s: steps[s]["generated_version"] for s in steps}
