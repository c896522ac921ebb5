"""PPO with a critic, end to end with real processes: the critic trains alone through its warm-up and
then beside the policy, both sleep when offloaded, checkpoints keep both; an eval-only PPO job
builds no critic (the critic process it could use stays unconfigured; `rlfleet run` starts none)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from services.api import coordinator_pb2, trainer_pb2, trainer_pb2_grpc
from services.launcher import LocalFleet
from services.trainer.critic import VALUE_HEAD_FILE
from tests.integration.conftest import channel, run_job
from tests.integration.test_cli_run import _children

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith"
TRAIN, TEST = EXAMPLE / "data" / "train.jsonl", EXAMPLE / "data" / "test.jsonl"


@pytest.fixture(scope="module")
def ppo_fleet(tmp_path_factory):
    """A trainer, a critic (a second trainer server), an engine and a coordinator that knows them."""
    local = LocalFleet(tmp_path_factory.mktemp("ppo-logs"), env={"OMP_NUM_THREADS": "1"})
    root = str(tmp_path_factory.getbasetemp())
    try:
        trainer = local.start("trainer", "trainer-0", ["--checkpoint-root", root])
        critic = local.start("trainer", "critic-0", ["--checkpoint-root", root])
        rollout = local.start("rollout", "rollout-0", [])
        local.wait_ready()
        coordinator = local.start("coordinator", "coordinator",
                                  ["--trainers", trainer.address, "--critics", critic.address,
                                   "--rollouts", rollout.address, "--db", "memory",
                                   "--runs-dir", str(tmp_path_factory.mktemp("runs"))])
        local.wait_ready()
        yield {"trainer": trainer.address, "critic": critic.address, "rollout": rollout.address,
               "coordinator": coordinator.address}
    finally:
        local.stop()


def _status(address: str) -> trainer_pb2.TrainerStatus:
    with channel(address) as ch:
        return trainer_pb2_grpc.TrainerStub(ch).GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10)


def _ppo_job(out: Path, *, num_rollout: int = 4, extra: str = "") -> str:
    return textwrap.dedent(f"""
        name: ppo
        seed: 2
        model: {EXAMPLE / 'model'}
        num_rollout: {num_rollout}
        output_dir: {out}
        rollout: {{prompts_per_step: 8, samples_per_prompt: 4, sampling: {{max_new_tokens: 5}}}}
        data: {{train: {TRAIN}}}
        eval: {{every: 0, datasets: [{{name: heldout, path: {TEST}, limit: 32, sampling: {{max_new_tokens: 5}}}}]}}
        algorithm: {{advantage: ppo, gamma: 1.0, lam: 0.95}}
        trainer: {{offload: true, optimizer: {{lr: 0.001}}}}
        critic: {{warmup_steps: 2, optimizer: {{lr: 0.001}}}}
        """) + extra


def test_a_ppo_job_trains_the_critic_alone_then_both_and_checkpoints_both(ppo_fleet, tmp_path):
    final, events = run_job(ppo_fleet["coordinator"], _ppo_job(tmp_path, extra="checkpoint: {every: 2}\n"),
                            timeout_s=300)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    steps = [json.loads(e.data_json) for e in events if e.kind == "step"]
    assert len(steps) == 4
    for data in steps:
        assert data["value_loss"] > 0 and "critic/grad_norm" in data
        assert data["sync_from_host"] == 1.0  # the offloaded actor's syncs read its host copy
    # the policy waits out the critic's two warm-up steps (no policy step, version 0), then moves each step
    assert [d["weights_version"] for d in steps] == [0.0, 0.0, 1.0, 2.0]
    assert [("train/pg_loss" in d) for d in steps] == [False, False, True, True]
    assert any("explained_variance" in d for d in steps)

    actor, critic = _status(ppo_fleet["trainer"]), _status(ppo_fleet["critic"])
    assert (actor.role, actor.has_value_head, actor.step) == ("actor", False, 2)
    assert (critic.role, critic.has_value_head, critic.step) == ("critic", True, 4)
    assert critic.has_optimizer and critic.has_scheduler
    assert actor.lifecycle.asleep and critic.lifecycle.asleep  # both offloaded between steps
    assert critic.lifecycle.host_backup_bytes > 0

    last = tmp_path / "checkpoints" / "step-000004"
    assert (last / "critic" / VALUE_HEAD_FILE).exists() and (last / "critic" / "optimizer.safetensors").exists()
    assert not (last / VALUE_HEAD_FILE).exists()  # the policy's checkpoint stays a plain policy folder


def test_a_kl_penalty_in_the_reward_is_felt_once_the_policy_moves(ppo_fleet, tmp_path):
    job = _ppo_job(tmp_path, num_rollout=4).replace(
        "algorithm: {advantage: ppo, gamma: 1.0, lam: 0.95}",
        "algorithm: {advantage: ppo, gamma: 1.0, lam: 1.0, kl_coef: 0.5, use_kl_loss: false}")
    final, events = run_job(ppo_fleet["coordinator"], job, timeout_s=300)
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    steps = [json.loads(e.data_json) for e in events if e.kind == "step"]
    # until the policy first moves (two critic-only steps, then its first step at step 3) the
    # engine's policy is the reference and the penalty is the engine-vs-trainer gap, about 0;
    # at step 4 it samples from a moved policy and the penalty is felt
    assert all(abs(s["kl_reward_mean"]) < 1e-3 for s in steps[:3])
    assert abs(steps[3]["kl_reward_mean"]) > 1e-4
    assert "train/kl" not in steps[3] and "train/pg_loss" in steps[3]  # in the reward, not in the loss


def test_an_eval_only_ppo_job_never_configures_a_critic(tmp_path, ppo_fleet):
    # a critic of its own that nothing else configures: after the eval it is still unconfigured
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    try:
        critic = local.start("trainer", "critic-0", [])
        local.wait_ready()
        coordinator = local.start("coordinator", "coordinator",
                                  ["--trainers", ppo_fleet["trainer"], "--critics", critic.address,
                                   "--rollouts", ppo_fleet["rollout"], "--db", "memory", "--runs-dir", str(tmp_path)])
        local.wait_ready()
        job = textwrap.dedent(f"""
            name: ppo-eval
            model: {EXAMPLE / 'model'}
            num_rollout: 0
            output_dir: {tmp_path / 'out'}
            eval: {{datasets: [{{name: heldout, path: {TEST}, limit: 16, sampling: {{max_new_tokens: 5}}}}]}}
            algorithm: {{advantage: ppo}}
            critic: {{num_critics: 1}}
            """)
        final, _ = run_job(coordinator.address, job, timeout_s=120)
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
        status = _status(critic.address)
        assert not status.configured and not status.has_value_head and status.num_parameters == 0
    finally:
        local.stop()


def _rlfleet_run(job: Path, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", "run", str(job), "--no-progress"], cwd=cwd,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _roles_while_running(proc: subprocess.Popen) -> set[str]:
    """Every `rlfleet serve ROLE` child seen (by its name) in the process list until `proc` ends."""
    seen: set[str] = set()
    while proc.poll() is None:
        for cmd in _children(proc.pid).values():
            if "serve" in cmd.split():
                seen.add(cmd.split()[cmd.split().index("serve") + 1])
        time.sleep(0.05)
    return seen


def test_rlfleet_run_starts_a_critic_for_ppo_only_and_prints_what_it_learns(tmp_path):
    train = tmp_path / "ppo.yaml"
    train.write_text(_ppo_job(tmp_path / "train", num_rollout=3))
    proc = _rlfleet_run(train, tmp_path)
    roles = _roles_while_running(proc)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert roles == {"trainer", "rollout", "coordinator"}
    assert sorted(p.name for p in (tmp_path / "train" / "logs").iterdir()) == [
        "coordinator.log", "critic-0.log", "rollout-0.log", "trainer-0.log"]
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 3 and all("value loss" in line and " ev " in line for line in lines), out

    evaluate = tmp_path / "eval.yaml"  # the same PPO settings, evaluated: no trainer, no critic
    evaluate.write_text(textwrap.dedent(f"""
        name: ppo-eval
        model: {EXAMPLE / 'model'}
        num_rollout: 0
        output_dir: {tmp_path / 'eval'}
        eval: {{datasets: [{{name: heldout, path: {TEST}, limit: 16, sampling: {{max_new_tokens: 5}}}}]}}
        algorithm: {{advantage: ppo}}
        """))
    proc = _rlfleet_run(evaluate, tmp_path)
    roles = _roles_while_running(proc)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert roles == {"rollout", "coordinator"}
    assert sorted(p.name for p in (tmp_path / "eval" / "logs").iterdir()) == ["coordinator.log", "rollout-0.log"]


def test_two_critic_ranks_train_one_value_model(tmp_path, ppo_fleet):
    # the module's policy trainer and engine (each job configures them afresh), two critics of its own
    local = LocalFleet(tmp_path / "logs", env={"OMP_NUM_THREADS": "1"})
    try:
        critics = [local.start("trainer", f"critic-{i}", ["--checkpoint-root", str(tmp_path)]) for i in range(2)]
        local.wait_ready()
        coordinator = local.start("coordinator", "coordinator", [
            "--trainers", ppo_fleet["trainer"], "--critics", ",".join(c.address for c in critics),
            "--rollouts", ppo_fleet["rollout"], "--db", "memory", "--runs-dir", str(tmp_path)])
        local.wait_ready()
        job = _ppo_job(tmp_path / "out", num_rollout=2, extra="checkpoint: {every: 2}\n").replace(
            "critic: {warmup_steps: 2", "critic: {num_critics: 2, warmup_steps: 1")
        final, events = run_job(coordinator.address, job, timeout_s=300)
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
        statuses = [_status(c.address) for c in critics]
        assert [(s.rank, s.world_size, s.step, s.role) for s in statuses] == [(0, 2, 2, "critic"), (1, 2, 2, "critic")]
        assert "2 rank(s)" in " ".join(json.loads(e.data_json).get("message", "") for e in events if e.kind == "log")
        # one model: the checkpoint rank 0 wrote holds the value head both ranks trained
        assert (tmp_path / "out" / "checkpoints" / "step-000002" / "critic" / VALUE_HEAD_FILE).exists()
    finally:
        local.stop()
