"""The critic (PPO's value model) in process: values line up with response tokens, the clipped value
loss pulls them towards the returns, sleep/wake keeps them, and checkpoints carry the head."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.trainer import checkpoint
from services.trainer.backend import TrainerStateError, build_backend
from services.trainer.batch import Sample
from services.trainer.critic import VALUE_HEAD_FILE, TorchCritic
from services.trainer.losses import value_loss
from services.trainer.settings import LossSettings, OptimizerSettings, TrainerSettings
from services.models import load_hf_dir
from tests.conftest import make_tiny_model


def _settings(model_dir, **overrides) -> TrainerSettings:
    base = TrainerSettings(model_path=str(model_dir), role="critic",
                           optimizer=OptimizerSettings(lr=3e-2, grad_clip=0.0), loss=LossSettings(value_clip=0.0))
    return dataclasses.replace(base, **overrides)


def _samples(returns: list[list[float]]) -> list[Sample]:
    prompts = [[3, 4, 5], [9, 10]]
    responses = [[6, 7, 8], [11]]
    return [Sample(prompt_ids=p, response_ids=r, returns=ret) for p, r, ret in zip(prompts, responses, returns)]


def _flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def test_value_loss_clips_against_the_old_values():
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[2.0, 0.5]])
    mask = torch.ones(1, 2)
    # token 0 moved 1.0 from old; clipped to 0.2 it is further from the return: the clipped error counts
    loss, metrics = value_loss(values, old, returns, mask, value_clip=0.2, agg="token_mean")
    expected = 0.5 * ((2.0 - 0.2) ** 2 + (0.5 - 0.0) ** 2) / 2
    assert loss.item() == pytest.approx(expected)
    assert metrics["value_clip_frac"].item() == pytest.approx(0.5)
    unclipped, _ = value_loss(values, old, returns, mask, value_clip=0.0, agg="token_mean")
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.25) / 2)
    with pytest.raises(ValueError, match="returns: shape"):
        value_loss(values, old, returns[:, :1], mask, value_clip=0.2)


def test_a_critic_starts_at_zero_and_regresses_its_values_onto_the_returns(tiny_model_dir):
    critic = build_backend(_settings(tiny_model_dir))
    assert isinstance(critic, TorchCritic) and critic.has_optimizer
    targets = [[1.0, 0.5, -0.5], [2.0]]
    samples = _samples(targets)
    first = critic.compute_values(samples)
    assert [len(v) for v in first] == [3, 1]  # one value per response token
    assert all(v == 0.0 for row in first for v in row)  # a fresh head: every value is 0
    losses = [critic.train_step(samples, value=True).metrics["value_loss"] for _ in range(40)]
    after = critic.compute_values(samples)
    assert losses[-1] < 0.1 * losses[0]
    for row, want in zip(after, targets):
        assert row == pytest.approx(want, abs=0.3)


def test_a_critic_refuses_policy_calls_and_never_serves_weights(tiny_model_dir):
    critic = build_backend(_settings(tiny_model_dir))
    with pytest.raises(TrainerStateError, match="critic"):
        critic.compute_logprobs("actor", _samples([[0.0] * 3, [0.0]]))
    with pytest.raises(TrainerStateError, match="never synced"):
        critic.weights_for_sync()
    with pytest.raises(TrainerStateError, match="value loss"):
        critic.train_step(_samples([[0.0] * 3, [0.0]]), sft=True)
    with pytest.raises(TrainerStateError, match="value loss"):
        critic.train_step(_samples([[0.0] * 3, [0.0]]))  # the policy loss
    with pytest.raises(ValueError, match=r"samples\[0\]\.returns"):
        critic.train_step([Sample(prompt_ids=[3], response_ids=[4])], value=True)
    with pytest.raises(ValueError, match="non-finite|not a finite"):
        critic.train_step(_samples([[float("nan"), 0.0, 0.0], [0.0]]), value=True)


def test_an_actor_refuses_the_critics_calls(tiny_model_dir):
    actor = build_backend(dataclasses.replace(_settings(tiny_model_dir), role="actor", loss=LossSettings()))
    with pytest.raises(TrainerStateError, match="this trainer is an actor"):
        actor.compute_values(_samples([[0.0] * 3, [0.0]]))
    with pytest.raises(TrainerStateError, match="LOSS_KIND_VALUE trains a critic"):
        actor.train_step(_samples([[0.0] * 3, [0.0]]), value=True)


@pytest.mark.parametrize("overrides, message", [
    ({"backend": "megatron"}, "torch backend only"),
    ({"eval_only": True}, "eval-only job builds no critic"),
    ({"tags": ("ref",)}, "critic keeps no extra copies"),
    ({"role": "judge"}, "role: expected one of"),
])
def test_critic_settings_that_make_no_sense_are_refused(tiny_model_dir, overrides, message):
    with pytest.raises(ValueError, match=message):
        _settings(tiny_model_dir, **overrides)


def test_sleep_and_wake_keep_the_critics_values(tiny_model_dir):
    critic = build_backend(_settings(tiny_model_dir, offload=True))
    samples = _samples([[1.0, 1.0, 1.0], [1.0]])
    for _ in range(3):
        critic.train_step(samples, value=True)
    before = critic.compute_values(samples)
    state = critic.sleep()
    assert state.asleep and state.host_backup_bytes > 0
    assert critic.compute_values(samples) == before  # woken on demand, values restored from the host copy
    assert not critic.lifecycle().asleep


def test_a_critic_checkpoint_is_a_policy_folder_plus_its_head(tmp_path, tiny_model_dir):
    critic = build_backend(_settings(tiny_model_dir))
    samples = _samples([[1.0, 0.0, -1.0], [0.5]])
    for _ in range(3):
        critic.train_step(samples, value=True)
    values = critic.compute_values(samples)
    folder = tmp_path / "critic"
    critic.save_checkpoint(str(folder), include_optimizer=True)
    assert (folder / VALUE_HEAD_FILE).exists() and (folder / checkpoint.OPTIMIZER_FILE).exists()
    load_hf_dir(folder)  # the backbone is a valid policy checkpoint
    # configured from its checkpoint, a critic starts where the saved one stopped
    again = build_backend(_settings(folder))
    assert _flat(again.compute_values(samples)) == pytest.approx(_flat(values), abs=1e-6)
    # load_checkpoint restores weights, head and optimizer into a running critic
    fresh = build_backend(_settings(tiny_model_dir))
    fresh.load_checkpoint(str(folder), load_optimizer=True)
    assert _flat(fresh.compute_values(samples)) == pytest.approx(_flat(values), abs=1e-6)
    assert fresh.step == critic.step
    # a policy folder is not a critic checkpoint
    with pytest.raises(checkpoint.CheckpointError, match="not a critic's checkpoint"):
        fresh.load_checkpoint(str(tiny_model_dir), load_optimizer=False)


def test_a_head_of_the_wrong_shape_is_refused(tmp_path):
    small = make_tiny_model(tmp_path / "small")
    critic = build_backend(_settings(small))
    critic.save_checkpoint(str(tmp_path / "ckpt"), include_optimizer=False)
    other = make_tiny_model(tmp_path / "wide", hidden_size=48, head_dim=12)
    (tmp_path / "ckpt" / VALUE_HEAD_FILE).rename(other / VALUE_HEAD_FILE)
    with pytest.raises(checkpoint.CheckpointError, match="value_head.weight is"):
        build_backend(_settings(other))
