"""Advantage estimators: hand-computed values, flat groups, and the dispatcher."""

from __future__ import annotations

import math

import pytest
import torch

from services.coordinator.advantages import compute_advantages, dr_grpo, grpo, reinforce_pp, reinforce_pp_baseline


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_grpo_uses_the_unbiased_group_std():
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    out = grpo(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 1.0, 1.0]]))
    close(out[0:1], [[0.866025, -0.866025, -0.866025, 0.866025]])
    # second group: mean 1, unbiased std sqrt(2/3) = 0.816497
    close(out[1:2], [[1.224744, -1.224744, 0.0, 0.0]])


def test_grpo_without_std_is_mean_centred():
    close(grpo(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), normalize_std=False), [[0.75, -0.25, -0.25, -0.25]])


def test_dr_grpo_subtracts_the_group_mean_only():
    close(dr_grpo(torch.tensor([[3.0, 1.0], [0.0, 1.0]])), [[1.0, -1.0], [-0.5, 0.5]])


def test_reinforce_pp_whitens_over_the_batch_without_a_group_baseline():
    # flat mean 0.75, unbiased std 0.5: a group of equal rewards above the batch mean still gets credit
    close(reinforce_pp(torch.tensor([[1.0, 0.0], [1.0, 1.0]])), [[0.5, -1.5], [0.5, 0.5]])
    # one sample per prompt works (no group needed)
    close(reinforce_pp(torch.tensor([[1.0], [0.0]])), [[1 / math.sqrt(2)], [-1 / math.sqrt(2)]])


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens():
    # centred [[.5, -.5], [0, 0]]: batch mean 0, unbiased std sqrt(0.5 / 3) = 0.408248
    close(reinforce_pp_baseline(torch.tensor([[1.0, 0.0], [1.0, 1.0]])), [[1.224745, -1.224745], [0.0, 0.0]])


@pytest.mark.parametrize("estimator", [grpo, dr_grpo, reinforce_pp_baseline])
def test_flat_groups_get_exactly_zero(estimator):
    # The float32 mean of eight 0.1s is off by ~7e-9, which a naive (r - mean) / (0 + 1e-6) turns into 0.007.
    rewards = torch.tensor([[0.1] * 8, [0.3] * 8, [1.0, 0.0] * 4])
    naive = (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-6)
    assert naive[:2].abs().max() > 1e-3  # the trap is real
    out = estimator(rewards)
    assert torch.isfinite(out).all()
    assert (out[:2] == 0).all()
    assert (out[2] != 0).all()


def test_a_flat_batch_and_single_samples_give_zero_not_nan():
    assert (reinforce_pp(torch.full((3, 2), 0.1)) == 0).all()
    assert (grpo(torch.tensor([[1.0], [0.0]])) == 0).all()  # a group of one carries no signal
    assert (reinforce_pp(torch.tensor([[0.3]])) == 0).all()


def test_output_shape_and_dtype_follow_the_input():
    rewards = torch.rand(5, 8)
    for kind in ("grpo", "dr_grpo", "reinforce_pp", "reinforce_pp_baseline"):
        out = compute_advantages(kind, rewards)
        assert out.shape == (5, 8) and out.dtype == torch.float32


def test_integer_rewards_are_accepted():
    close(compute_advantages("dr_grpo", [[1, 0]]), [[0.5, -0.5]])


def test_dispatcher_passes_options_and_ignores_normalize_std_where_it_does_not_apply():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    close(compute_advantages("grpo", rewards, normalize_std=False), [[0.75, -0.25, -0.25, -0.25]])
    close(compute_advantages("dr_grpo", rewards, normalize_std=True), [[0.75, -0.25, -0.25, -0.25]])
    with pytest.raises(TypeError):
        compute_advantages("dr_grpo", rewards, bogus=1)


def test_dispatcher_rejects_unknown_kinds_and_ppo():
    with pytest.raises(ValueError, match="unknown estimator 'gpro'"):
        compute_advantages("gpro", torch.zeros(1, 2))
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("ppo", torch.zeros(1, 2))


def test_bad_rewards_are_rejected():
    with pytest.raises(ValueError, match="num_prompts, n"):
        grpo(torch.zeros(4))
    with pytest.raises(ValueError, match="NaN"):
        grpo(torch.tensor([[1.0, float("nan")]]))
