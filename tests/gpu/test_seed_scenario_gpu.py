"""The seed scenario (miles #3128): an offloaded trainer, exact verification, the first sync against
a sleeping trainer, then RL steps, through `rlfleet run`: on one GPU over CUDA IPC, and with the
trainer on GPU 0 and the engine on GPU 1 over an NCCL broadcast (the seed's own placement)."""

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


@pytest.mark.parametrize(("trainer_device", "engine_devices", "plane", "colocate"), [
    pytest.param("cuda", "[]", "cuda_ipc", True, id="one-gpu"),
    pytest.param("cuda:0", "[cuda:1]", "broadcast", False, id="two-gpus", marks=TWO_GPUS),
])
def test_offloaded_exact_rl_job(tmp_path, trainer_device, engine_devices, plane, colocate):
    job = tmp_path / "job.yaml"
    job.write_text(
        textwrap.dedent(
            f"""
            name: seed-scenario
            seed: 1
            model: {EXAMPLE / 'model'}
            num_rollout: 4
            output_dir: {tmp_path / 'out'}
            rollout: {{prompts_per_step: 32, samples_per_prompt: 8, sampling: {{max_new_tokens: 5}}, devices: {engine_devices}}}
            data: {{train: {EXAMPLE / 'data' / 'train.jsonl'}}}
            eval: {{every: 2, datasets: [{{name: heldout, path: {EXAMPLE / 'data' / 'test.jsonl'}, limit: 200, sampling: {{max_new_tokens: 5}}}}]}}
            trainer: {{device: {trainer_device}, offload: true, colocate: {str(colocate).lower()}, optimizer: {{lr: 1.0e-4}}}}
            weight_sync: {{verify: exact}}
            """
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(job), "--summary", str(tmp_path / "summary.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 4
    assert all(s.get("metrics", s)["sync_from_host"] == 1.0 for s in steps)  # every sync read the host store
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["eval_before"] > 0.2  # exact weights, not the scrambled start
    assert f"': '{plane}'" in result.stdout  # the negotiated plane (logged as {engine address: plane})
    evals = [json.loads(line) for line in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == 3
    # each step says where its time went, sleep and wake included; the on-policy gap is float32-small
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 4 and all("generate" in l and "wake" in l and "sleep" in l and "sync" in l for l in lines), lines
    print("\n".join(lines))
    assert all(s.get("metrics", s)["train/rollout_logprob_gap_max"] < 1e-3 for s in steps)
