"""Eval-only jobs (seed: slime #2296): no optimizer, no scheduler, no critic, no trainer at all when
the engines can load the checkpoint; results labelled with the checkpoint's step and equal to
what the training job reported for that checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from services.api import coordinator_pb2, trainer_pb2, trainer_pb2_grpc
from services.trainer.checkpoint import OPTIMIZER_FILE
from tests.integration.conftest import addresses, channel, run_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith"
TEST_DATA = EXAMPLE / "data" / "test.jsonl"


def _run_job(fleet, text: str):
    return run_job(addresses(fleet)["coordinator"], text, timeout_s=300)


def _trainer_status(fleet) -> trainer_pb2.TrainerStatus:
    with channel(addresses(fleet)["trainer"]) as ch:
        return trainer_pb2_grpc.TrainerStub(ch).GetStatus(trainer_pb2.GetTrainerStatusRequest(), timeout=10)


def _eval_job(model: Path, out: Path, extra: str = "") -> str:
    return textwrap.dedent(
        f"""
        name: eval-only
        seed: 3
        model: {model}
        num_rollout: 0
        output_dir: {out}
        eval: {{datasets: [{{name: heldout, path: {TEST_DATA}, limit: 64, sampling: {{max_new_tokens: 5}}}}]}}
        """
    ) + extra


def _train_job(out: Path) -> str:
    return textwrap.dedent(
        f"""
        name: train-then-checkpoint
        seed: 3
        model: {EXAMPLE / 'model'}
        num_rollout: 2
        output_dir: {out}
        rollout: {{prompts_per_step: 8, samples_per_prompt: 4, sampling: {{max_new_tokens: 5}}}}
        data: {{train: {EXAMPLE / 'data' / 'train.jsonl'}}}
        eval: {{every: 0, datasets: [{{name: heldout, path: {TEST_DATA}, limit: 64, sampling: {{max_new_tokens: 5}}}}]}}
        trainer: {{optimizer: {{lr: 0.001}}, scheduler: {{kind: cosine, warmup_steps: 1}}}}
        checkpoint: {{every: 2}}
        """
    )


def test_training_builds_optimizer_and_eval_only_does_not(fleet, tmp_path):
    final, _ = _run_job(fleet, _train_job(tmp_path / "train"))
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    status = _trainer_status(fleet)
    assert status.has_optimizer and status.has_scheduler

    # warm-up longer than decay, PPO: both meaningless without training, so neither matters
    extra = "algorithm: {advantage: ppo}\ntrainer: {scheduler: {kind: cosine, warmup_steps: 50, decay_steps: 10}}\n"
    checkpoint = tmp_path / "train" / "checkpoints" / "step-000002"
    final, events = _run_job(fleet, _eval_job(checkpoint, tmp_path / "eval", extra))
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    status = _trainer_status(fleet)  # the static fleet lent the eval-only job its trainer
    assert not status.has_optimizer and not status.has_scheduler
    assert status.checkpoint_step == 2
    evals = [e for e in events if e.kind == "eval"]
    assert len(evals) == 1 and evals[0].step == 2  # labelled with the checkpoint's step, not 0
    assert not [e for e in events if e.kind in ("step", "sft")]


def test_eval_only_on_a_checkpoint_matches_what_training_reported(fleet, tmp_path):
    final, events = _run_job(fleet, _train_job(tmp_path / "train"))
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    trained = json.loads(final.summary_json)["eval_after"]
    checkpoint = tmp_path / "train" / "checkpoints" / "step-000002"
    (checkpoint / OPTIMIZER_FILE).write_bytes(b"corrupt")  # eval-only never reads it
    final, _ = _run_job(fleet, _eval_job(checkpoint, tmp_path / "eval"))
    assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
    summary = json.loads(final.summary_json)
    assert summary["eval_only"] and summary["checkpoint_step"] == 2
    assert summary["evals_after"]["heldout"] == trained
    assert 0 < trained < 1
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["evals_after"] == {"heldout": trained}


def _rlfleet_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "run", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def test_eval_only_from_a_hugging_face_folder_starts_no_trainer(tmp_path):
    job = tmp_path / "eval.yaml"
    job.write_text(_eval_job(EXAMPLE / "model", tmp_path / "out", "algorithm: {advantage: ppo}\n"))
    result = _rlfleet_run([str(job), "--summary", str(tmp_path / "summary.json")], tmp_path)
    assert result.returncode == 0, result.stderr
    logs = sorted(p.name for p in (tmp_path / "out" / "logs").iterdir())
    assert logs == ["coordinator.log", "rollout-0.log"]  # no trainer, no critic: nothing else ran
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["trainers"] == 0 and 0 < summary["evals_after"]["heldout"] < 1
    assert "heldout" in result.stdout and "eval-only" in result.stdout


def test_eval_only_without_eval_data_is_rejected_before_anything_starts(tmp_path):
    job = tmp_path / "eval.yaml"
    job.write_text(f"name: no-data\nmodel: {EXAMPLE / 'model'}\nnum_rollout: 0\noutput_dir: {tmp_path / 'out'}\n")
    result = _rlfleet_run([str(job)], tmp_path)
    assert result.returncode == 2
    assert "eval.datasets" in result.stderr
    assert not (tmp_path / "out").exists()
