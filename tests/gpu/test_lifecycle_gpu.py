"""On a GPU, Sleep hands the trainer's weight, gradient and optimizer memory back to the device
(NVML sees it free), and training after WakeUp continues exactly as if it never slept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from services.models import DecoderLM, ModelConfig, init_weights, save_hf_dir
from services.trainer.batch import Sample
from services.trainer.settings import OptimizerSettings, TrainerSettings
from services.trainer.torch_backend import TorchTrainer

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> Path:
    """About 0.6 GB of fp32 weights: large enough that NVML's granularity does not matter."""
    directory = tmp_path_factory.mktemp("mid-model")
    config = ModelConfig(
        architecture="qwen3", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=256,
    )
    model = DecoderLM(config)
    init_weights(model, seed=0)
    save_hf_dir(model, config, directory)
    return directory


def _samples() -> list[Sample]:
    return [Sample(prompt_ids=list(range(1, 33)), response_ids=list(range(33, 65)), advantages=[0.5] * 32)] * 4


def _trainer(model_dir: Path, **kw) -> TorchTrainer:
    return TorchTrainer(
        TrainerSettings(model_path=str(model_dir), device="cuda", offload=True, optimizer=OptimizerSettings(lr=1e-4), **kw)
    )


def _nvml_used_by_me() -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        index = torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return proc.usedGpuMemory
        return pynvml.nvmlDeviceGetMemoryInfo(handle).used  # containers may hide pids
    finally:
        pynvml.nvmlShutdown()


def test_sleep_frees_device_memory_as_nvml_sees_it(mid_model):
    trainer = _trainer(mid_model)
    trainer.train_step(_samples())
    torch.cuda.synchronize()
    held = trainer.lifecycle().gpu_bytes_in_use  # weights + grads + Adam moments
    before = _nvml_used_by_me()
    state = trainer.sleep()
    after = _nvml_used_by_me()
    print(f"held {held / 1e9:.2f} GB; NVML {before / 1e9:.2f} -> {after / 1e9:.2f} GB")
    assert state.asleep and state.gpu_bytes_in_use == 0
    assert before - after >= 0.9 * held
    trainer.wake()
    assert _nvml_used_by_me() > after


def test_training_after_wake_matches_a_run_that_never_slept(mid_model):
    steady = _trainer(mid_model)
    steady_losses = [steady.train_step(_samples()).metrics["loss"] for _ in range(3)]
    steady_params = [p.detach().clone() for p in steady.params]
    del steady
    torch.cuda.empty_cache()
    napping = _trainer(mid_model)
    losses = []
    for _ in range(3):
        losses.append(napping.train_step(_samples()).metrics["loss"])
        napping.sleep()
        napping.wake()
    assert losses == steady_losses
    for a, b in zip(steady_params, napping.params):
        assert torch.equal(a, b)


def test_tag_switching_on_gpu_restores_exact_values(mid_model):
    trainer = _trainer(mid_model, tags=("ref",))
    initial = [p.detach().clone() for p in trainer.params]
    trainer.train_step(_samples())
    trained = [p.detach().clone() for p in trainer.params]
    trainer.use("ref")
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, initial))
    trainer.sleep()
    trainer.use("actor")
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, trained))


def test_fingerprints_made_at_capture_match_the_host_copy(tmp_path):
    """A sync from the host copy trusts the fingerprints Sleep made on the device beside the copy."""
    from services.trainer.host_store import ACTOR
    from services.weights.fingerprint import fingerprint
    from tests.conftest import make_tiny_model

    trainer = TorchTrainer(TrainerSettings(model_path=str(make_tiny_model(tmp_path / "m")), device="cuda",
                                           bucket_bytes=16 << 10))
    trainer.sleep()
    copy = trainer.store.get(ACTOR)
    assert len(copy.buffers) > 2
    assert copy.fingerprints["fast"] == [fingerprint(b, "fast") for b in copy.buffers]


def test_the_actor_host_copy_is_shared_and_page_locked(tmp_path):
    """Engines on the trainer's GPU map the sleeping trainer's host copy by name and copy it to
    the device themselves, so it lives in /dev/shm, registered with CUDA in the trainer."""
    from services.trainer.host_store import ACTOR
    from services.weights.shm import SHM_DIR
    from tests.conftest import make_tiny_model

    trainer = TorchTrainer(TrainerSettings(model_path=str(make_tiny_model(tmp_path / "m")), device="cuda", offload=True))
    trainer.sleep()
    copy = trainer.store.get(ACTOR)
    assert copy.segment_names and all((SHM_DIR / n).exists() for n in copy.segment_names)
    assert all(b.is_pinned() for b in copy.buffers)
    trainer.close()
    assert not any((SHM_DIR / n).exists() for n in copy.segment_names)
