"""A rollout worker that dies and comes back at another address (a Kubernetes pod restarted on a
new IP) is followed: the coordinator reaches it where discovery now says it is, configures it,
gives it the current weights, and the job finishes instead of failing."""

from __future__ import annotations

import os
import signal
import textwrap

import pytest

from services.coordinator.discovery import StaticDiscovery, make_fleet
from services.coordinator.jobs import JobManager
from services.launcher import LocalFleet

pytestmark = pytest.mark.faults


def test_a_job_follows_its_only_engine_to_a_new_address(tmp_path, tiny_model_dir, task_files):
    train, test = task_files
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    later = LocalFleet(tmp_path / "logs-later", env={"OMP_NUM_THREADS": "1"})  # the pod after its restart
    manager = None
    try:
        trainer = local.start("trainer", "trainer-0", [])
        first = local.start("rollout", "rollout-0", [])
        local.wait_ready()
        discovery = StaticDiscovery([trainer.address], [first.address])
        manager = JobManager(make_fleet(discovery, wait_s=30), runs_dir=tmp_path / "runs")
        job = manager.create(textwrap.dedent(f"""
            name: moving-engine
            model: {tiny_model_dir}
            num_rollout: 8
            rollout: {{prompts_per_step: 4, samples_per_prompt: 4, sampling: {{max_new_tokens: 3}}}}
            data: {{train: {train}}}
            eval: {{datasets: [{{name: heldout, path: {test}, limit: 8, sampling: {{max_new_tokens: 3}}}}]}}
            trainer: {{optimizer: {{lr: 0.01}}}}
            """), str(tmp_path))
        moved = False
        for event in manager.watch(job.id):
            if event.kind == "step" and event.step == 2 and not moved:
                os.kill(first.process.pid, signal.SIGKILL)  # the pod dies...
                second = later.start("rollout", "rollout-0b", [])  # ...and comes back elsewhere
                later.wait_ready()
                discovery._ready.replace([trainer.address], [second.address])
                moved = True
        final = manager.get(job.id)
        messages = [e.data.get("message", "") for e in manager.store.events(job.id, 0, 10_000) if e.kind == "log"]
        assert final.state == "succeeded", (final.error, messages[-5:])
        assert any(f"moved from {first.address} to {second.address}" in m for m in messages), messages
        steps = [e for e in manager.store.events(job.id, 0, 10_000) if e.kind == "step"]
        assert [e.step for e in steps] == list(range(1, 9))
        # after the move every step's rollouts came from the new engine, at the current version
        assert all(e.data["weights_version"] == e.step for e in steps)
    finally:
        if manager is not None:
            manager.close()
        local.stop()
        later.stop()
