"""The seed scenario (miles #3128) on one GPU: an offloaded trainer, exact verification, the first
sync against a sleeping trainer, then RL steps, through `rlfleet run` and the CUDA IPC plane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith"


def test_offloaded_exact_rl_job_on_one_gpu(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        textwrap.dedent(
            f"""
            name: seed-scenario
            seed: 1
            model: {EXAMPLE / 'model'}
            num_rollout: 4
            output_dir: {tmp_path / 'out'}
            rollout: {{prompts_per_step: 32, samples_per_prompt: 8, sampling: {{max_new_tokens: 5}}}}
            data: {{train: {EXAMPLE / 'data' / 'train.jsonl'}}}
            eval: {{every: 2, datasets: [{{name: heldout, path: {EXAMPLE / 'data' / 'test.jsonl'}, limit: 200, sampling: {{max_new_tokens: 5}}}}]}}
            trainer: {{device: cuda, offload: true, optimizer: {{lr: 1.0e-4}}}}
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
    assert "cuda_ipc" in result.stdout  # the negotiated plane: trainer and engine share the GPU
    evals = [json.loads(line) for line in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == 3
