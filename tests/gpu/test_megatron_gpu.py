"""The megatron backend on one GPU: an RL job from a Hugging Face checkpoint with the built-in
engine and exact verification, sleep that NVML sees, and eval-only without optimizer or
scheduler. (Tensor and pipeline parallel need several GPUs: they are tested on CPU over gloo.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from services.models import DecoderLM, ModelConfig, init_weights, save_hf_dir  # noqa: E402
from services.trainer.batch import Sample  # noqa: E402
from services.trainer.settings import OptimizerSettings, SchedulerSettings, TrainerSettings  # noqa: E402
from tests.gpu.test_lifecycle_gpu import _nvml_used_by_me  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.megatron]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith"


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("mid-model")
    config = ModelConfig(
        architecture="qwen2", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
    )
    model = DecoderLM(config)
    init_weights(model, seed=0)
    save_hf_dir(model, config, directory)
    return directory


def _trainer(model_dir: Path, **kw):
    from services.trainer.megatron_backend import MegatronTrainer

    return MegatronTrainer(TrainerSettings(model_path=str(model_dir), backend="megatron", device="cuda",
                                           optimizer=OptimizerSettings(lr=1e-4), **kw))


def test_eval_only_builds_no_optimizer_and_no_scheduler(mid_model):
    # decay 0 would make Megatron's OptimizerParamScheduler assert: eval-only never builds one
    trainer = _trainer(mid_model, eval_only=True, scheduler=SchedulerSettings(kind="cosine", decay_steps=0))
    try:
        assert not trainer.has_optimizer and not trainer.has_scheduler
    finally:
        trainer.close()


def test_sleep_frees_device_memory_as_nvml_sees_it(mid_model):
    trainer = _trainer(mid_model, offload=True)
    try:
        samples = [Sample(prompt_ids=list(range(1, 33)), response_ids=list(range(33, 65)), advantages=[0.5] * 32)] * 4
        trainer.train_step(samples)
        torch.cuda.synchronize()
        held = trainer.lifecycle().gpu_bytes_in_use
        before = _nvml_used_by_me()
        state = trainer.sleep()
        after = _nvml_used_by_me()
        print(f"held {held / 1e9:.2f} GB; NVML {before / 1e9:.2f} -> {after / 1e9:.2f} GB")
        assert state.asleep and state.gpu_bytes_in_use == 0
        assert before - after >= 0.9 * held
    finally:
        trainer.close()


def test_rl_job_from_a_hugging_face_checkpoint_with_exact_verification(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""
        name: megatron-gpu
        seed: 1
        model: {EXAMPLE / 'model'}
        num_rollout: 6
        output_dir: {tmp_path / 'out'}
        rollout: {{prompts_per_step: 32, samples_per_prompt: 8, sampling: {{max_new_tokens: 5}}}}
        data: {{train: {EXAMPLE / 'data' / 'train.jsonl'}}}
        eval: {{every: 3, datasets: [{{name: heldout, path: {EXAMPLE / 'data' / 'test.jsonl'}, limit: 200, sampling: {{max_new_tokens: 5}}}}]}}
        trainer: {{backend: megatron, device: cuda, offload: true, colocate: true, optimizer: {{lr: 1.0e-4}}}}
        weight_sync: {{verify: exact}}
        """))
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(job), "--summary", str(tmp_path / "summary.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "megatron backend" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    # exact verification starts the engine from scrambled weights: only a verified sync scores
    assert summary["steps"] == 6 and summary["eval_before"] > 0.2
    print("\n".join(line for line in result.stdout.splitlines() if line.startswith("step ")))
