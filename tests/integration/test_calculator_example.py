"""The calculator example learns to use its tool: `rlfleet run examples/calculator/job.yaml`,
shortened to 20 steps. The warmed-up model seldom calls the calculator and cannot multiply; GRPO
on whole episodes (call, the tool's answer read with loss mask 0, the answer) makes it call the
tool, and held-out greedy accuracy rises with the fraction of episodes that call it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calculator"


def test_the_calculator_example_learns_to_call_its_tool(tmp_path):
    job = tmp_path / "job.yaml"
    text = (EXAMPLE / "job.yaml").read_text().replace("./", f"{EXAMPLE}/")
    job.write_text(text.replace("num_rollout: 40", "num_rollout: 20").replace("limit: 500", "limit: 200"))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "services.cli", "run", str(job), "--output-dir", str(out)],
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [json.loads(line)["metrics"] for line in (out / "eval.jsonl").read_text().splitlines()]
    first, last = evals[0], evals[-1]
    assert last["score"] - first["score"] >= 0.10, evals
    assert first["tool_call_frac"] < 0.1 and last["tool_call_frac"] > first["tool_call_frac"] + 0.2, evals
    assert all(e["episodes_failed"] == 0 for e in evals)
    steps = [json.loads(line)["metrics"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 20 and all(0.0 <= s["tool_call_frac"] <= 1.0 for s in steps)
    assert all(s["train/rollout_logprob_gap_max"] < 1e-3 for s in steps)  # the engine's tokens, scored as sampled
    printed = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(printed) == 20 and all(" tool " in line for line in printed)  # tool use, every step


def test_an_agent_job_on_chat_prompts_frames_its_observations_with_the_template(tmp_path):
    """The calculator model with a chat template of its own and conversation rows
    (data.messages_key): the job renders prompts with the template and appends each tool reply
    as a `tool` message of it (tests/unit/test_agents.py checks the frame token by token). The
    episodes that called the tool are trained on with the engine's own logprobs."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(EXAMPLE / "model", model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                               "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    rows = [json.loads(line) for line in (EXAMPLE / "data" / "train.jsonl").read_text().splitlines()[:256]]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]})
                            + "\n" for r in rows))
    job = tmp_path / "job.yaml"
    job.write_text(f"""
name: calculator-chat
seed: 1
model: {model}
num_rollout: 3
output_dir: {tmp_path / 'out'}
agent: {{environment: calculator, max_turns: 3, max_tokens: 128, max_tool_calls: 1}}
rollout: {{prompts_per_step: 16, samples_per_prompt: 4, sampling: {{temperature: 1.0, max_new_tokens: 72}}}}
data: {{train: {data}, messages_key: messages}}
eval: {{every: 0, datasets: [{{name: h, path: {data}, limit: 16, sampling: {{temperature: 0.0, max_new_tokens: 72}}}}]}}
trainer: {{micro_batch_size: 64, optimizer: {{lr: 1.0e-4}}}}
""")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "run", str(job)], cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["metrics"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3 and sum(s["tool_calls_mean"] for s in steps) > 0  # observations were appended
    assert all(s["train/rollout_logprob_gap_max"] < 1e-3 and s["episodes_failed"] == 0 for s in steps)
    # the job frames with the template it was given: one that cannot render a tool message is refused
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                               "{% endif %}{{ m['content'] }}{% endfor %}")
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "services.cli", "run", str(job)], cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "cannot render a 'tool' message: no tools" in proc.stderr + proc.stdout
