"""A coordinator process that serves its API (REST, gRPC, the job store, discovery) starts
without importing torch: 3.4 s of every coordinator start on a 2-core machine. torch comes in
with the first RL step, which needs it for the advantage maths."""

from __future__ import annotations

import subprocess
import sys


def test_serving_the_coordinator_api_does_not_import_torch():
    code = ("import sys\n"
            "import services.cli, services.coordinator.serve, services.coordinator.server\n"
            "import services.coordinator.jobs, services.coordinator.rest, services.coordinator.discovery\n"
            "from services.coordinator.serve import build_coordinator\n"
            "from services.models import load_tokenizer\n"
            "print('torch' in sys.modules)\n"
            "from services.models import DecoderLM\n"  # the lazy exports still resolve
            "print('torch' in sys.modules, DecoderLM.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "True", "DecoderLM"], out.stderr
