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
