"""The torch trainer backend in process: RL and SFT steps move the policy the right way, micro-batching
does not change the update, and eval-only builds no optimizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.trainer.batch import Sample
from services.trainer.settings import LossSettings, OptimizerSettings, SchedulerSettings, TrainerSettings
from services.trainer.torch_backend import TorchTrainer, TrainerStateError, lr_lambda


def _settings(model_dir, **overrides) -> TrainerSettings:
    base = TrainerSettings(model_path=str(model_dir), optimizer=OptimizerSettings(lr=1e-2, grad_clip=0.0))
    return dataclasses.replace(base, **overrides)


def _samples(advantage: float) -> list[Sample]:
    return [
        Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7, 8], advantages=[advantage] * 3),
        Sample(prompt_ids=[9, 10], response_ids=[11], advantages=[advantage]),
    ]


@pytest.mark.parametrize("advantage, direction", [(1.0, 1), (-1.0, -1)])
def test_policy_step_moves_logprob_of_sampled_tokens_with_the_advantage(tiny_model_dir, advantage, direction):
    trainer = TorchTrainer(_settings(tiny_model_dir))
    samples = _samples(advantage)
    before, _ = trainer.compute_logprobs("actor", samples)
    result = trainer.train_step(samples)
    after, _ = trainer.compute_logprobs("actor", samples)
    assert result.weights_version == 1 and result.step == 1
    delta = sum(map(sum, after)) - sum(map(sum, before))
    assert delta * direction > 0


def test_sft_step_lowers_the_loss_on_its_batch(tiny_model_dir):
    trainer = TorchTrainer(_settings(tiny_model_dir))
    samples = _samples(0.0)
    first = trainer.train_step(samples, sft=True).metrics["sft_loss"]
    for _ in range(5):
        last = trainer.train_step(samples, sft=True).metrics["sft_loss"]
    assert last < first


def test_micro_batch_size_does_not_change_the_update(tiny_model_dir):
    samples = _samples(1.0) * 3
    results = []
    for micro in (1, 64):
        trainer = TorchTrainer(_settings(tiny_model_dir, micro_batch_size=micro))
        trainer.train_step(samples)
        results.append([p.grad.clone() for p in trainer.model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in results[0])


def test_ref_copy_stays_frozen_while_the_actor_trains(tiny_model_dir):
    trainer = TorchTrainer(_settings(tiny_model_dir, tags=("ref",)))
    samples = _samples(1.0)
    ref_before, _ = trainer.compute_logprobs("ref", samples)
    trainer.train_step(samples)
    ref_after, _ = trainer.compute_logprobs("ref", samples)
    actor_after, _ = trainer.compute_logprobs("actor", samples)
    assert ref_after == ref_before and actor_after != ref_after
    with pytest.raises(ValueError, match="teacher"):
        trainer.compute_logprobs("teacher", samples)


def test_kl_loss_needs_ref_logprobs(tiny_model_dir):
    trainer = TorchTrainer(_settings(tiny_model_dir, loss=LossSettings(kl_coef=0.1), tags=("ref",)))
    with pytest.raises(ValueError, match="ref_logprobs"):
        trainer.train_step(_samples(1.0))
    samples = _samples(1.0)
    refs, _ = trainer.compute_logprobs("ref", samples)
    with_ref = [dataclasses.replace(s, ref_logprobs=r) for s, r in zip(samples, refs)]
    metrics = trainer.train_step(with_ref).metrics
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step starts at the reference


def test_eval_only_builds_no_optimizer_or_scheduler_even_with_an_impossible_schedule(tiny_model_dir):
    impossible = SchedulerSettings(kind="cosine", warmup_steps=10, decay_steps=0)
    trainer = TorchTrainer(_settings(tiny_model_dir, eval_only=True, scheduler=impossible))
    assert trainer.optimizer is None and trainer.scheduler is None
    logprobs, _ = trainer.compute_logprobs("actor", _samples(0.0))
    assert len(logprobs[0]) == 3
    with pytest.raises(TrainerStateError, match="eval_only"):
        trainer.train_step(_samples(1.0))
    with pytest.raises(ValueError, match="decay_steps"):
        TorchTrainer(_settings(tiny_model_dir, scheduler=impossible))


def test_bad_samples_name_the_field(tiny_model_dir):
    trainer = TorchTrainer(_settings(tiny_model_dir))
    with pytest.raises(ValueError, match=r"samples\[0\]\.advantages"):
        trainer.train_step([Sample(prompt_ids=[1], response_ids=[2, 3], advantages=[1.0])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        trainer.train_step([Sample(prompt_ids=[1], response_ids=[10_000], advantages=[1.0])])


def test_lr_schedules():
    cosine = lr_lambda(SchedulerSettings(kind="cosine", warmup_steps=2, decay_steps=12, min_lr_ratio=0.1))
    assert [round(cosine(s), 3) for s in (0, 1, 2, 7, 12, 50)] == [0.5, 1.0, 1.0, 0.55, 0.1, 0.1]
    linear = lr_lambda(SchedulerSettings(kind="linear", decay_steps=10))
    assert linear(5) == pytest.approx(0.5)


def test_an_lr_override_applies_to_one_step_and_leaves_the_schedule_alone(tiny_model_dir):
    schedule = SchedulerSettings(kind="linear", decay_steps=10)
    trainer = TorchTrainer(_settings(tiny_model_dir, scheduler=schedule))
    assert trainer.train_step(_samples(0.0), sft=True, lr=0.5).metrics["lr"] == 0.5
    assert trainer.train_step(_samples(1.0)).metrics["lr"] == pytest.approx(1e-2)  # schedule still at step 0
    assert trainer.train_step(_samples(1.0)).metrics["lr"] == pytest.approx(0.9e-2)


@pytest.mark.parametrize("field, value", [("advantages", float("nan")), ("advantages", float("inf")),
                                          ("loss_mask", float("nan")), ("old_logprobs", float("-inf")),
                                          ("ref_logprobs", float("nan")), ("loss_mask", -1.0)])
def test_non_finite_inputs_are_refused_by_name_and_change_nothing(tiny_model_dir, field, value):
    trainer = TorchTrainer(_settings(tiny_model_dir))
    before = [p.detach().clone() for p in trainer.params]
    good = _samples(1.0)
    poisoned = [dataclasses.replace(good[0], **{field: [0.5, value, 0.5]}), good[1]]
    with pytest.raises(ValueError, match=rf"batch.samples\[0\].{field}"):
        trainer.train_step(poisoned)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params)) and trainer.weights_version == 0


@pytest.mark.parametrize("lr", [float("inf"), float("nan"), -1e-3])
def test_a_non_finite_or_negative_learning_rate_is_refused(tiny_model_dir, lr):
    trainer = TorchTrainer(_settings(tiny_model_dir))
    with pytest.raises(ValueError, match="lr: must be a finite number"):
        trainer.train_step(_samples(1.0), lr=lr)
    assert trainer.weights_version == 0


def test_a_step_whose_gradient_is_not_finite_is_skipped_and_keeps_the_weights(tiny_model_dir):
    trainer = TorchTrainer(_settings(tiny_model_dir))
    before = [p.detach().clone() for p in trainer.params]
    huge = _samples(3e38)  # finite advantages whose gradient overflows float32
    result = trainer.train_step(huge)
    assert result.metrics["step_skipped"] == 1.0 and not torch.isfinite(torch.tensor(result.metrics["grad_norm"]))
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params))
    assert result.weights_version == 0  # nothing new to sync
    assert trainer.train_step(_samples(1.0)).weights_version == 1  # and the trainer trains on


def test_off_policy_correction_reweights_each_token_of_stale_samples(tiny_model_dir):
    """Samples whose engine logprobs say an older policy drew them: with tis each token's
    gradient is scaled by min(pi_now / pi_old, cap) and PPO's ratio is taken against pi_now;
    without a correction the ratio against pi_old clips. Same samples, different updates."""
    base = TorchTrainer(_settings(tiny_model_dir))
    samples = _samples(1.0)
    now, _ = base.compute_logprobs("actor", samples)
    stale = [dataclasses.replace(s, old_logprobs=[lp - 0.5 for lp in lps]) for s, lps in zip(samples, now)]  # w = e^0.5
    grads, metrics = {}, {}
    for correction in ("none", "tis", "decoupled"):
        loss = LossSettings(correction=correction, is_cap=1.5)
        trainer = TorchTrainer(_settings(tiny_model_dir, loss=loss))
        metrics[correction] = trainer.train_step(stale).metrics
        grads[correction] = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    assert metrics["tis"]["is_weight_mean"] == pytest.approx(2.718281828 ** 0.5, rel=1e-4)
    assert metrics["tis"]["is_capped_frac"] == 1.0 and "is_weight_mean" not in metrics["none"]
    assert metrics["none"]["clip_frac"] == 1.0  # ratio e^0.5 > 1.2 with A > 0: clipped, no gradient
    assert grads["none"].abs().max() == 0
    # tis: the plain policy gradient times the cap; decoupled: every token over the cap left out
    assert grads["tis"].abs().max() > 0 and grads["decoupled"].abs().max() == 0


def test_an_unknown_correction_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="loss.correction: unknown 'importance'"):
        LossSettings(correction="importance")
    with pytest.raises(ValueError, match="loss.is_cap"):
        LossSettings(correction="tis", is_cap=0.0)
