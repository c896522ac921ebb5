"""Trainer checkpoints: a Hugging Face folder plus optimizer state, resumable exactly; an eval-only
trainer never reads the optimizer file, so a missing or corrupt one does not matter to it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.models import load_hf_dir
from services.models.checkpoint import checkpoint_step
from services.trainer.batch import Sample
from services.trainer.checkpoint import OPTIMIZER_FILE, CheckpointError
from services.trainer.settings import OptimizerSettings, SchedulerSettings, TrainerSettings
from services.trainer.torch_backend import TorchTrainer


def _trainer(model_dir, **overrides) -> TorchTrainer:
    base = TrainerSettings(
        model_path=str(model_dir), optimizer=OptimizerSettings(lr=1e-2),
        scheduler=SchedulerSettings(kind="linear", decay_steps=20),
    )
    return TorchTrainer(dataclasses.replace(base, **overrides))


def _samples() -> list[Sample]:
    return [Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7], advantages=[1.0, 1.0])] * 2


@pytest.fixture
def checkpoint(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir)
    for _ in range(3):
        trainer.train_step(_samples())
    trainer.save_checkpoint(str(tmp_path / "ckpt"), include_optimizer=True)
    return trainer, tmp_path / "ckpt"


def test_checkpoint_is_a_hugging_face_folder_labelled_with_its_step(checkpoint):
    trainer, path = checkpoint
    _, model = load_hf_dir(path)
    for (name, saved), live in zip(model.named_parameters(), trainer.params):
        assert torch.equal(saved, live), name
    assert (path / "tokenizer.json").exists()
    assert checkpoint_step(path) == 3


def test_resuming_with_optimizer_state_continues_exactly(checkpoint, tiny_model_dir):
    original, path = checkpoint
    resumed = _trainer(tiny_model_dir)
    resumed.load_checkpoint(str(path), load_optimizer=True)
    assert resumed.step == 3
    a, b = original.train_step(_samples()), resumed.train_step(_samples())
    assert a.metrics["loss"] == b.metrics["loss"] and a.metrics["lr"] == b.metrics["lr"]
    for p, q in zip(original.params, resumed.params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_eval_only_trainer_evaluates_a_checkpoint_with_bad_optimizer_state(checkpoint, tiny_model_dir, damage):
    trainer, path = checkpoint
    if damage == "missing":
        (path / OPTIMIZER_FILE).unlink()
    else:
        (path / OPTIMIZER_FILE).write_bytes(b"\x00garbage" * 10)
    evaluator = _trainer(tiny_model_dir, eval_only=True, scheduler=SchedulerSettings(kind="cosine", warmup_steps=5, decay_steps=0))
    evaluator.load_checkpoint(str(path), load_optimizer=True)
    assert evaluator.optimizer is None and evaluator.scheduler is None
    expected, _ = trainer.compute_logprobs("actor", _samples())
    assert evaluator.compute_logprobs("actor", _samples())[0] == expected
    learner = _trainer(tiny_model_dir)
    with pytest.raises(CheckpointError, match=OPTIMIZER_FILE):
        learner.load_checkpoint(str(path), load_optimizer=True)


def test_loading_a_checkpoint_of_another_shape_names_the_tensor(checkpoint, tmp_path):
    from tests.conftest import make_tiny_model

    _, path = checkpoint
    other = make_tiny_model(tmp_path / "other", architecture="llama")
    with pytest.raises((CheckpointError, ValueError), match="q_norm|k_norm|missing"):
        _trainer(other).load_checkpoint(str(path), load_optimizer=False)
