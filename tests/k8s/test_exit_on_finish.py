"""`rlfleet serve coordinator --job FILE --exit-on-finish`, what the eval-mode Kubernetes Job runs.

The function behind the flag submits the file to a JobManager, follows the job and returns the
process exit code: 0 when the job succeeded, 1 when it failed or was stopped, 2 when the file is
not a valid job; the result is the last line on stdout, as JSON, for `kubectl logs`. The
successful case runs the coordinator as a process against an emulated Kubernetes API and
in-process trainer and rollout servers.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services import cli
from services.coordinator.fleet import static_fleet
from services.coordinator.jobs import JobManager

pytestmark = pytest.mark.k8s

log = logging.getLogger("test.exit_on_finish")
ROOT = Path(__file__).resolve().parents[2]


def write_eval_job(tmp_path, model_dir, eval_file, name="ev") -> object:
    path = tmp_path / "job.yaml"
    path.write_text(
        f"""
name: {name}
model: {model_dir}
num_rollout: 0
eval:
  datasets:
    - {{name: held-out, path: {eval_file}, limit: 4, sampling: {{max_new_tokens: 3}}}}
trainer: {{micro_batch_size: 8, optimizer: {{lr: 1.0e-3}}}}
weight_sync: {{bucket_mb: 1}}
"""
    )
    return path


def result_line(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_job_that_fails_exits_1_with_the_error(tmp_path, tiny_model_dir, task_files, capsys, caplog):
    manager = JobManager(static_fleet([], []), runs_dir=tmp_path / "runs")  # no workers at all
    job = write_eval_job(tmp_path, tiny_model_dir, task_files[1])
    with caplog.at_level(logging.INFO):
        code = cli.run_job_file(manager, job, threading.Event(), log)
    assert code == cli.EXIT_FAILED == 1
    result = result_line(capsys)
    assert result["state"] == "failed" and result["name"] == "ev"
    assert "rollout.num_engines: job wants 1, coordinator knows 0" in result["error"]
    assert "rollout.num_engines" in caplog.text


def test_only_a_long_running_coordinators_job_file_is_idempotent(tmp_path, tiny_model_dir, task_files, capsys):
    manager = JobManager(static_fleet([], []), runs_dir=tmp_path / "runs")
    job = write_eval_job(tmp_path, tiny_model_dir, task_files[1])
    ids = []
    for idempotent in (True, True, False):
        assert cli.run_job_file(manager, job, threading.Event(), log, idempotent=idempotent) == 1
        ids.append(result_line(capsys)["job_id"])
    assert ids[0] == ids[1] != ids[2]  # a restart finds its job; a one-shot run always runs


def test_an_invalid_job_file_exits_2_naming_the_field(tmp_path, tiny_model_dir, capsys):
    manager = JobManager(static_fleet([], []), runs_dir=tmp_path / "runs")
    job = tmp_path / "job.yaml"
    job.write_text(f"name: ev\nmodel: {tiny_model_dir}\nnum_rollout: 0\n")  # eval-only without datasets
    assert cli.run_job_file(manager, job, threading.Event(), log) == cli.EXIT_CONFIG
    result = result_line(capsys)
    assert result["state"] == "invalid" and "eval.datasets" in result["error"]
    assert cli.run_job_file(manager, tmp_path / "missing.yaml", threading.Event(), log) == cli.EXIT_CONFIG


def test_stopping_cancels_the_job_and_exits_1(tmp_path, tiny_model_dir, task_files, capsys):
    def slow_fleet(job):
        time.sleep(0.3)
        raise RuntimeError("no fleet")

    stop = threading.Event()
    stop.set()  # SIGTERM arrived (activeDeadlineSeconds, a deleted Job) before the job ended
    manager = JobManager(slow_fleet, runs_dir=tmp_path / "runs")
    code = cli.run_job_file(manager, write_eval_job(tmp_path, tiny_model_dir, task_files[1]), stop, log)
    assert code == 1
    assert result_line(capsys)["state"] in ("cancelled", "failed")


def test_a_coordinator_process_finds_its_pods_runs_the_eval_and_exits_0(tmp_path, tiny_model_dir, task_files):
    """What the eval Job's pod does, as a process: Kubernetes discovery (an emulated API server,
    reached through a kubeconfig) finds a ready trainer and rollout pod, the eval-only job runs on
    them, and the process exits 0 with the result as the last line of its output."""
    pytest.importorskip("kmock")
    import kubernetes

    from services.rollout.server import build_server as rollout_server
    from services.trainer.server import build_server as trainer_server
    from tests.k8s.emulator import EmulatorThread

    # Pods share one gRPC port, as in a cluster: the "pod IPs" are two loopback addresses.
    trainer = trainer_server("127.0.0.1:0")
    rollout = rollout_server(f"127.0.0.2:{trainer.port}")
    try:
        with EmulatorThread() as cluster:
            api = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(kubernetes.client.Configuration(host=cluster.url)))
            for role, ip in (("trainer", "127.0.0.1"), ("rollout", "127.0.0.2")):
                api.create_namespaced_pod("evals", {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"demo-{role}-0", "namespace": "evals", "labels": {
                        "app.kubernetes.io/name": "rlfleet", "app.kubernetes.io/instance": "demo",
                        "app.kubernetes.io/component": role}},
                    "spec": {"containers": [{"name": role, "image": "rlfleet"}]},
                    "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
                })
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": cluster.url}}],
                "users": [{"name": "kmock", "user": {"token": "unused"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}],
            }))
            env = {**os.environ, "KUBECONFIG": str(kubeconfig), "OMP_NUM_THREADS": "1"}
            env.pop("KUBERNETES_SERVICE_HOST", None)
            done = subprocess.run(
                [sys.executable, "-m", "services.cli", "serve", "coordinator", "--port", "0",
                 "--discovery", "kubernetes", "--namespace", "evals", "--instance", "demo",
                 "--worker-port", str(trainer.port), "--eval-trainers", "1", "--discovery-wait-s", "20",
                 "--runs-dir", str(tmp_path / "runs"), "--db", str(tmp_path / "jobs.db"),
                 "--job", str(write_eval_job(tmp_path, tiny_model_dir, task_files[1])), "--exit-on-finish"],
                capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
            )
    finally:
        trainer.stop(0)
        rollout.stop(0)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["state"] == "succeeded" and result["error"] == ""
    assert set(result["summary"]["evals_after"]) == {"held-out"}
    assert f"trainers ['127.0.0.1:{trainer.port}'], rollouts ['127.0.0.2:{trainer.port}']" in done.stderr


def test_the_flags_parse_and_guard_their_use(capsys):
    args = cli.build_parser().parse_args(
        ["serve", "coordinator", "--discovery", "kubernetes", "--namespace", "evals", "--instance", "demo",
         "--job", "/config/job.yaml", "--exit-on-finish"]
    )
    assert (args.discovery, args.namespace, args.instance, args.worker_port) == ("kubernetes", "evals", "demo", 50051)
    assert args.exit_on_finish and args.job == "/config/job.yaml"
    assert cli.main(["serve", "trainer", "--job", "x.yaml"]) == cli.EXIT_CONFIG
    assert cli.main(["serve", "coordinator", "--exit-on-finish"]) == cli.EXIT_CONFIG
    assert "--job FILE" in capsys.readouterr().err
