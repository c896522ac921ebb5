"""PPO on one GPU, colocated and offloaded (issue #21): the actor and the critic each sleep when not
computing, NVML sees both models' memory freed, every sync reads the actor's host copy, and the
rewards equal those of the same job without offload (same seed)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from services.api import coordinator_pb2, trainer_pb2, trainer_pb2_grpc
from services.launcher import LocalFleet
from tests.conftest import make_tiny_model
from tests.integration.conftest import channel, run_job

pytestmark = pytest.mark.gpu
PROMPTS = "\n".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) for a in range(10, 40) for b in range(10, 14))


def digit_share(completion: str, answer: str, prompt: str) -> float:
    """A reward a random char-level model earns unevenly: the share of digits in its completion."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> Path:
    """A char-level model of about 135M parameters (0.54 GB in fp32): weights, gradients and Adam
    moments come to about 2 GB per model, far above NVML's granularity."""
    return make_tiny_model(tmp_path_factory.mktemp("mid"), hidden_size=1024, intermediate_size=2816,
                           num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2, head_dim=128)


def _nvml_used() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())).used
    finally:
        pynvml.nvmlShutdown()


def _trainer_call(address: str, method: str):
    with channel(address) as ch:
        stub = trainer_pb2_grpc.TrainerStub(ch)
        request = {"GetStatus": trainer_pb2.GetTrainerStatusRequest(), "Sleep": trainer_pb2.SleepRequest(),
                   "WakeUp": trainer_pb2.WakeUpRequest()}[method]
        return getattr(stub, method)(request, timeout=120)


def _run(tmp_path: Path, model: Path, *, offload: bool):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "train.jsonl"
    data.write_text(PROMPTS + "\n")
    local = LocalFleet(tmp_path / "logs")
    trainer = local.start("trainer", "trainer-0", ["--checkpoint-root", str(tmp_path)])
    critic = local.start("trainer", "critic-0", ["--checkpoint-root", str(tmp_path)])
    rollout = local.start("rollout", "rollout-0", [])
    local.wait_ready(timeout_s=300)
    coordinator = local.start("coordinator", "coordinator", [
        "--trainers", trainer.address, "--critics", critic.address, "--rollouts", rollout.address,
        "--db", "memory", "--runs-dir", str(tmp_path), "--allow-reward-module", "tests.gpu.test_ppo_gpu"])
    local.wait_ready()
    job = textwrap.dedent(f"""
        name: ppo-gpu
        seed: 5
        model: {model}
        num_rollout: 3
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 16, samples_per_prompt: 4, sampling: {{max_new_tokens: 6}}}}
        data: {{train: {data}}}
        reward: {{kind: python, function: "tests.gpu.test_ppo_gpu:digit_share"}}
        eval: {{every: 0, datasets: [{{name: heldout, path: {data}, limit: 16, sampling: {{max_new_tokens: 6}}}}]}}
        algorithm: {{advantage: ppo}}
        trainer: {{device: cuda, offload: {str(offload).lower()}, colocate: true, optimizer: {{lr: 1.0e-5}}}}
        critic: {{warmup_steps: 1, optimizer: {{lr: 1.0e-5}}}}
        """)
    final, events = run_job(coordinator.address, job, timeout_s=400)
    return local, trainer.address, critic.address, final, [json.loads(e.data_json) for e in events if e.kind == "step"]


def test_colocated_offloaded_ppo_frees_both_models_and_matches_a_run_without_offload(tmp_path, mid_model):
    local, actor, critic, final, steps = _run(tmp_path / "offload", mid_model, offload=True)
    try:
        assert final.state == coordinator_pb2.JOB_STATE_SUCCEEDED, final.error
        assert all(s["sync_from_host"] == 1.0 for s in steps)  # the sync read the actor's host copy
        statuses = [_trainer_call(a, "GetStatus") for a in (actor, critic)]
        assert [s.role for s in statuses] == ["actor", "critic"]
        assert all(s.lifecycle.asleep and s.lifecycle.gpu_bytes_in_use == 0 for s in statuses)
        asleep = _nvml_used()
        held = [_trainer_call(a, "WakeUp").status.gpu_bytes_in_use for a in (actor, critic)]
        awake = _nvml_used()
        for a in (actor, critic):
            _trainer_call(a, "Sleep")
        again = _nvml_used()
        print(f"actor {held[0] / 1e9:.2f} GB, critic {held[1] / 1e9:.2f} GB awake; "
              f"NVML {asleep / 1e9:.2f} -> {awake / 1e9:.2f} -> {again / 1e9:.2f} GB")
        assert min(held) > 1.5e9  # weights, gradients and Adam moments of each model
        assert awake - asleep >= 0.9 * sum(held) and awake - again >= 0.9 * sum(held)
    finally:
        local.stop()
    local, _, _, plain, plain_steps = _run(tmp_path / "resident", mid_model, offload=False)
    local.stop()
    assert plain.state == coordinator_pb2.JOB_STATE_SUCCEEDED, plain.error
    assert [s["reward_mean"] for s in steps] == [s["reward_mean"] for s in plain_steps]
    assert [s["value_loss"] for s in steps] == pytest.approx([s["value_loss"] for s in plain_steps], rel=1e-3)
    print("rewards", [round(s["reward_mean"], 4) for s in steps], "value loss", [round(s["value_loss"], 4) for s in steps])
