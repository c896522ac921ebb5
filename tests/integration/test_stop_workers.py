"""A one-shot coordinator (`--job --exit-on-finish --stop-workers-on-finish`, the eval Job on
Kubernetes) tells its workers to exit when its job ends, so they free their devices then."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from services.launcher import LocalFleet


def test_workers_exit_cleanly_when_the_one_job_ends(tmp_path, tiny_model_dir, task_files):
    _, test = task_files
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    try:
        trainer = local.start("trainer", "trainer-0", [])
        rollout = local.start("rollout", "rollout-0", [])
        local.wait_ready()
        job = tmp_path / "eval.yaml"
        job.write_text(textwrap.dedent(f"""
            name: eval-then-stop
            model: {tiny_model_dir}
            num_rollout: 0
            eval: {{datasets: [{{name: heldout, path: {test}, limit: 4, sampling: {{max_new_tokens: 2}}}}]}}
            """))
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", "serve", "coordinator", "--trainers", trainer.address,
             "--rollouts", rollout.address, "--job", str(job), "--exit-on-finish", "--stop-workers-on-finish",
             "--db", "memory", "--runs-dir", str(tmp_path / "runs")],
            capture_output=True, text=True, timeout=180,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert '"state": "succeeded"' in done.stdout
        deadline = time.monotonic() + 60
        while any(c.process.poll() is None for c in local.children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [c.process.poll() for c in local.children] == [0, 0]  # both exited, cleanly
        assert "shutdown requested" in trainer.log_tail(40)
    finally:
        local.stop()


def test_a_worker_exits_non_zero_when_signalled_if_asked(tmp_path):
    """A worker run as a Kubernetes Job must not count as done when a drain stops it."""
    import signal

    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    try:
        worker = local.start("rollout", "rollout-0", ["--exit-code-on-signal", "143"])
        local.wait_ready()
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=60) == 143
    finally:
        local.stop()
