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


# ---- Megatron's DDP, distributed optimizer and schedule (the megatron backend's optimizer on GPUs)


def _batch(seed: int, n: int = 8, length: int = 48) -> list[Sample]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        ids = torch.randint(5, 31000, (length,), generator=gen).tolist()
        samples.append(Sample(prompt_ids=ids[:16], response_ids=ids[16:],
                              advantages=torch.randn(length - 16, generator=gen).tolist()))
    return samples


def _bf16(model_dir: Path, backend: str, **kw):
    from services.trainer.backend import build_backend

    return build_backend(TrainerSettings(model_path=str(model_dir), backend=backend, device="cuda", dtype="bfloat16",
                                         master_weights="fp32", compile=False, **{"optimizer": OptimizerSettings(lr=1e-4), **kw}))


def _hf_weights(trainer) -> dict[str, torch.Tensor]:
    from services.trainer import megatron_model

    if trainer.settings.backend == "megatron":
        return {n: t.float().cpu() for n, t in megatron_model.gather_hf_state(trainer.model, trainer.model_config).items()}
    return {n: t.float().cpu() for n, t in trainer.named.items()}


def test_megatron_optimizer_trains_as_the_torch_backend_does(mid_model):
    """Megatron's DDP + distributed optimizer (fp32 main weights in shards, Adam) on one GPU take
    the same steps as the torch backend's AdamW over fp32 master weights: same losses, same
    gradient norms, and weights that moved the same way, within bf16 rounding."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    runs = {}
    for backend in ("torch", "megatron"):
        trainer = _bf16(mid_model, backend)
        try:
            if backend == "megatron":
                assert isinstance(trainer.ddp, DistributedDataParallel)
                assert isinstance(trainer._megatron_optimizer.distributed, DistributedOptimizer)
                assert isinstance(trainer.scheduler, OptimizerParamScheduler)
                assert all(g["fused"] for g in trainer.optimizer.param_groups)
            before = _hf_weights(trainer)
            metrics = [trainer.train_step(_batch(step)).metrics for step in range(3)]
            runs[backend] = (metrics, before, _hf_weights(trainer))
        finally:
            trainer.close()
    (m_torch, before, after_torch), (m_mega, _, after_mega) = runs["torch"], runs["megatron"]
    for a, b in zip(m_torch, m_mega):
        print(f"loss {a['loss']:.5f} / {b['loss']:.5f}; grad norm {a['grad_norm']:.4f} / {b['grad_norm']:.4f}")
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2, abs=2e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
        assert b["lr"] == a["lr"] == 1e-4
    moved = sum((after_torch[n] - before[n]).abs().mean() for n in before) / len(before)
    apart = sum((after_mega[n] - after_torch[n]).abs().mean() for n in before) / len(before)
    print(f"weights moved {moved:.2e} on average; the backends are {apart:.2e} apart")
    assert moved > 1e-5 and apart < 0.1 * moved


def test_megatron_schedule_is_optimizer_param_scheduler(mid_model):
    """Warm-up from 0 over 2 steps, then cosine decay to 10% at step 6, as Megatron computes it."""
    import math

    trainer = _bf16(mid_model, "megatron", scheduler=SchedulerSettings(kind="cosine", warmup_steps=2, decay_steps=6,
                                                                       min_lr_ratio=0.1))
    try:
        lrs = [trainer.train_step(_batch(step, n=2, length=24)).metrics["lr"] for step in range(8)]
    finally:
        trainer.close()
    peak, floor = 1e-4, 1e-5
    want = [0.0, peak / 2, peak] + [floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (n - 2) / 4)) for n in range(3, 7)] \
        + [floor]
    assert lrs == pytest.approx(want, rel=1e-6, abs=1e-12)


def test_megatron_sleep_and_wake_keep_the_optimizer_exact(mid_model):
    """Sleep frees DDP's parameter and gradient buffers, the main weights and Adam's moments as
    NVML sees it; wake brings back the weights, the main weights and the moments bit for bit."""
    trainer = _bf16(mid_model, "megatron", offload=True)
    try:
        trainer.train_step(_batch(0))
        mopt = trainer._megatron_optimizer

        def snapshot() -> list[torch.Tensor]:
            moments = [t for state in trainer.optimizer.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor) and t.dim() > 0]
            return [t.detach().cpu().clone() for t in [*trainer.params, *mopt.main_weights(), *moments]]

        before = snapshot()
        torch.cuda.synchronize()
        held, used = trainer.lifecycle().gpu_bytes_in_use, _nvml_used_by_me()
        state = trainer.sleep()
        freed = used - _nvml_used_by_me()
        print(f"held {held / 1e9:.2f} GB; NVML freed {freed / 1e9:.2f} GB")
        assert state.asleep and state.gpu_bytes_in_use == 0
        assert freed >= 0.9 * held
        trainer.wake()
        after = snapshot()
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after))
        assert all(float(g.abs().max()) == 0 for g in mopt.gradient_buffers())  # scratch comes back zeroed
        assert torch.isfinite(torch.tensor(trainer.train_step(_batch(1)).metrics["loss"]))
    finally:
        trainer.close()


def test_megatron_checkpoint_resumes_the_optimizer(mid_model, tmp_path):
    """A checkpoint with optimizer state (Adam's moments of the main shards, the schedule's
    position) resumes training where it stopped: the next step equals the uninterrupted one's."""
    kw = dict(scheduler=SchedulerSettings(kind="linear", warmup_steps=1, decay_steps=10))
    first = _bf16(mid_model, "megatron", **kw)
    try:
        for step in range(2):
            first.train_step(_batch(step))
        first.save_checkpoint(str(tmp_path / "ckpt"), include_optimizer=True)
        want = first.train_step(_batch(2)).metrics
    finally:
        first.close()
    second = _bf16(tmp_path / "ckpt", "megatron", **kw)
    try:
        second.load_checkpoint(str(tmp_path / "ckpt"), load_optimizer=True)
        got = second.train_step(_batch(2)).metrics
    finally:
        second.close()
    assert got["lr"] == pytest.approx(want["lr"], rel=1e-9)
    # the bf16 checkpoint rounds the fp32 main weights once: the same step, within that rounding
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-2)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=5e-2)
