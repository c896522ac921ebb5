"""bench/verify_floor.py, run as a user runs it: real processes (a gloo pair), real hashes.

The README's table of floors comes from this script, so it must keep printing one JSON line per
plane with the fields the table reads, and its floors must verify what they copied (the script
raises if a copy's fingerprint does not match) and cost at least the bare transfer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_cpu_floors_print_one_line_per_plane_each_no_faster_than_its_limit(tmp_path):
    out = tmp_path / "floor.jsonl"
    done = subprocess.run(
        # Five repeats: the median of two let one slow bare transfer (3x its usual time on a busy
        # 2-core box) put the floor at 1.8x the limit.
        [sys.executable, "bench/verify_floor.py", "--json", "--mb", "48", "--repeats", "5", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["plane"] for line in lines] == ["shm", "broadcast"]
    assert out.read_text().splitlines() == done.stdout.splitlines()  # --out keeps what was printed
    for line in lines:
        assert line["bytes"] == 48_000_000 and line["goal"] in (0.7, 0.85)
        assert line["limit_seconds"] > 0 and line["floor_seconds"] > 0
        # The floor adds both fingerprints to the transfer; well under the bare transfer's time
        # would mean a pass was skipped (1.5 leaves room for noise at this size on a shared machine).
        assert abs(line["floor_ratio"] - line["limit_seconds"] / line["floor_seconds"]) < 0.02, line
        assert 0 < line["floor_ratio"] < 1.5, line
    shm, gloo = lines
    assert shm["floor_seconds"] == min(shm["sequential_seconds"], shm["pipelined_seconds"])
    assert gloo["floor_seconds"] == min(gloo["sequential_seconds"], gloo["overlapped_seconds"])
