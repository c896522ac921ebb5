"""`rlfleet run examples/arith/megatron.yaml`: the RL job a user runs with the megatron backend,
two trainer processes as one tensor-parallel model, learns on this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith"


def test_megatron_tensor_parallel_job_learns(tmp_path):
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", "megatron.yaml", "--output-dir", str(tmp_path / "out"),
         "--summary", str(summary)],
        cwd=EXAMPLE, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megatron backend, 2 rank(s)" in proc.stdout
    result = json.loads(summary.read_text())
    assert result["eval_after"] - result["eval_before"] >= 0.10, result
