"""A single-turn job gives the results it gave before the agent code existed.

`golden/single_turn.json` holds what `rlfleet run` printed for this job at commit d5b7994, the last
one before agents: every step's rewards, lengths, loss and gradient norm, and the held-out evals.
The same job now must sample the same tokens (rewards, lengths and eval scores equal) and train
the same way: loss and gradient norm within 1e-4 relative, and approx_kl within 1e-6 absolute.
They were equal on the machine that wrote the file. On another CPU's float kernels the loss came
within 1.4e-5 relative, and approx_kl, float noise around 0 for on-policy samples, within 1.1e-7."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARITH = ROOT / "examples" / "arith"


def test_a_single_turn_job_gives_the_results_it_gave_before_agents(tmp_path):
    golden = json.loads((Path(__file__).parent / "golden" / "single_turn.json").read_text())
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        name: single-turn-golden
        seed: 3
        model: {ARITH / "model"}
        num_rollout: 6
        rollout: {{prompts_per_step: 16, samples_per_prompt: 4, sampling: {{temperature: 1.0, max_new_tokens: 5}}}}
        data: {{train: {ARITH / "data" / "train.jsonl"}}}
        reward: {{kind: exact_match}}
        eval: {{every: 3, datasets: [{{name: heldout, path: {ARITH / "data" / "test.jsonl"}, limit: 100,
                                      sampling: {{temperature: 0.0, max_new_tokens: 5}}}}]}}
        algorithm: {{advantage: grpo}}
        trainer: {{micro_batch_size: 64, optimizer: {{lr: 1.0e-4, betas: [0.9, 0.99], grad_clip: 1.0}}}}
        weight_sync: {{plane: grpc_stream, verify: fingerprint}}
        """))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "run", str(job), "--output-dir", str(out)],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [g["step"] for g in golden["steps"]]
    for now, then in zip(steps, golden["steps"]):
        m = now["metrics"]
        for key in ("reward_mean", "reward_std", "response_len_mean"):  # the sampled tokens
            assert m[key] == then[key], (now["step"], key, m[key], then[key])
        for key in ("train/loss", "train/grad_norm"):  # the update
            assert m[key] == pytest.approx(then[key], rel=1e-4, abs=1e-12), (now["step"], key)
        assert m["train/approx_kl"] == pytest.approx(then["train/approx_kl"], abs=1e-6), now["step"]
    assert [(e["step"], e["metrics"]["score"]) for e in evals] == [(g["step"], g["score"]) for g in golden["evals"]]
    assert "tool" not in "".join(line for line in proc.stdout.splitlines() if line.startswith("step "))
