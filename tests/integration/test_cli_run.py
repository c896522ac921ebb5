"""`rlfleet run` as a user runs it: a whole job in child processes, a summary, a plot; a config
mistake or a dead service gives a non-zero exit with the reason."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from services.launcher import ChildFailed, LocalFleet


def _job(tmp_path: Path, model_dir: Path, train: Path, test: Path, num_rollout: int) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            name: tiny
            model: {model_dir}
            num_rollout: {num_rollout}
            rollout: {{prompts_per_step: 4, samples_per_prompt: 4, sampling: {{max_new_tokens: 3}}}}
            data: {{train: {train}}}
            eval: {{every: 1, datasets: [{{name: heldout, path: {test}, limit: 8, sampling: {{max_new_tokens: 3}}}}]}}
            trainer: {{optimizer: {{lr: 0.01}}}}
            """
        )
    )
    return path


def _run(args: list[str], cwd: Path, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "run", *args],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs,
    )


def test_run_writes_summary_metrics_and_plot(tmp_path, tiny_model_dir, task_files):
    job = _job(tmp_path, tiny_model_dir, *task_files, num_rollout=2)
    summary_path = tmp_path / "summary.json"
    proc = _run([str(job), "--output-dir", str(tmp_path / "out"), "--summary", str(summary_path)], tmp_path)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 2 and summary["wall_s"] > 0
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    assert "== summary ==" in out and "heldout" in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]  # where each step's time went
    assert len(steps) == 2 and all(re.search(r"s: generate [\d.]+, train [\d.]+, sync [\d.]+\)$", s) for s in steps), steps
    assert len((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()) == 2
    assert len((tmp_path / "out" / "eval.jsonl").read_text().splitlines()) == 3  # before, step 1, after
    assert (tmp_path / "out" / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "out" / "logs" / "trainer-0.log").exists()


def test_unknown_key_is_rejected_before_anything_starts(tmp_path, tiny_model_dir, task_files):
    job = _job(tmp_path, tiny_model_dir, *task_files, num_rollout=1)
    job.write_text(job.read_text().replace("\nrollout:", "\nrollout_typo: {}\nrollout:"))
    proc = _run([str(job)], tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "rollout_typo" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("rows, message", [
    ("", "no rows"),
    ('{"prompt": "1+2=", "answer": "3"}\n{"question": "2+2=", "answer": "4"}\n', ":2: missing key 'prompt'"),
])
def test_a_dataset_that_cannot_be_read_is_rejected_before_anything_starts(tmp_path, tiny_model_dir, task_files,
                                                                          rows, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(rows)
    job = _job(tmp_path, tiny_model_dir, bad, task_files[1], num_rollout=1)
    started = time.monotonic()
    proc = _run([str(job)], tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "data.train:" in err and message in err, err
    assert time.monotonic() - started < 15 and not (tmp_path / "runs").exists()  # no service was started


def _children(pid: int) -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


def test_a_dead_trainer_stops_the_run_with_the_reason(tmp_path, tiny_model_dir, task_files):
    job = _job(tmp_path, tiny_model_dir, *task_files, num_rollout=10_000)
    proc = _run([str(job), "--output-dir", str(tmp_path / "out")], tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "out" / "metrics.jsonl").exists():  # wait until training is under way
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    trainer = next(pid for pid, cmd in _children(proc.pid).items() if "serve trainer" in cmd)
    os.kill(trainer, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3
    assert "trainer-0" in err and "exited with code -9" in err
    assert not _children(proc.pid)  # nothing left running


def test_launcher_names_a_child_that_died(tmp_path):
    fleet = LocalFleet(tmp_path, env={"OMP_NUM_THREADS": "1"})
    try:
        child = fleet.start("rollout", "rollout-7", [])
        fleet.wait_ready()
        child.process.kill()
        child.process.wait()
        with pytest.raises(ChildFailed, match="rollout-7"):
            fleet.check()
    finally:
        fleet.stop()


@pytest.mark.parametrize("sig, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated (SIGTERM)")])
def test_ctrl_c_or_sigterm_stops_every_service_and_exits_130(tmp_path, tiny_model_dir, task_files, sig, said):
    job = _job(tmp_path, tiny_model_dir, *task_files, num_rollout=10_000)
    tmp_before = {p.name for p in Path(tempfile.gettempdir()).glob("rlfleet-*")}
    proc = _run([str(job), "--output-dir", str(tmp_path / "out")], tmp_path)
    deadline = time.monotonic() + 120
    while not (tmp_path / "out" / "metrics.jsonl").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.2)
    children = _children(proc.pid)
    assert len(children) == 3
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)  # services get their grace, then SIGKILL: well under this
    except subprocess.TimeoutExpired:
        still = {pid: cmd for pid, cmd in _children(proc.pid).items()}
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"rlfleet run did not stop; children {still}; stderr: {err[-2000:]}")
    assert proc.returncode == 130 and said in err
    for pid in children:  # no service orphaned, the job does not carry on
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    leftover = {p.name for p in Path(tempfile.gettempdir()).glob("rlfleet-*")} - tmp_before
    assert not leftover, leftover  # the run's ready-file folder is gone too
