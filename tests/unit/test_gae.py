"""PPO's advantages: GAE against hand-computed references, token whitening, explained variance."""

from __future__ import annotations

import math

import pytest

from services.coordinator.advantages import explained_variance, gae, whiten_tokens

REWARDS = [0.0, 0.0, 1.0]  # the outcome reward on the last token
VALUES = [0.5, 0.2, 0.4]


def test_gae_with_gamma_and_lambda_one_is_the_monte_carlo_return_minus_the_value():
    # t=2: 1 - 0.4 = 0.6;  t=1: 0.4 - 0.2 + 0.6 = 0.8;  t=0: 0.2 - 0.5 + 0.8 = 0.5
    advantages, returns = gae(REWARDS, VALUES, gamma=1.0, lam=1.0)
    assert advantages == pytest.approx([0.5, 0.8, 0.6])
    assert returns == pytest.approx([1.0, 1.0, 1.0])


def test_gae_below_one():
    # delta = [0.9*0.2 - 0.5, 0.9*0.4 - 0.2, 1 - 0.4] = [-0.32, 0.16, 0.6]; gamma*lam = 0.45
    # A2 = 0.6;  A1 = 0.16 + 0.45*0.6 = 0.43;  A0 = -0.32 + 0.45*0.43 = -0.1265
    advantages, returns = gae(REWARDS, VALUES, gamma=0.9, lam=0.5)
    assert advantages == pytest.approx([-0.1265, 0.43, 0.6])
    assert returns == pytest.approx([0.3735, 0.63, 1.0])
    # lambda 0 is one-step TD: the advantage is delta itself
    td, _ = gae(REWARDS, VALUES, gamma=0.9, lam=0.0)
    assert td == pytest.approx([-0.32, 0.16, 0.6])


def test_gae_with_a_zero_critic_and_per_token_penalties():
    # a KL penalty of -0.1 on every token and the outcome 1 at the end; gamma = lam = 1
    advantages, returns = gae([-0.1, -0.1, 0.9], [0.0, 0.0, 0.0], gamma=1.0, lam=1.0)
    assert advantages == pytest.approx([0.7, 0.8, 0.9])
    assert returns == advantages


def test_gae_of_one_token_and_bad_input():
    assert gae([2.0], [0.5], gamma=0.9, lam=0.9) == (pytest.approx([1.5]), pytest.approx([2.0]))
    with pytest.raises(ValueError, match="3 rewards for 2 values"):
        gae(REWARDS, VALUES[:2], gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="NaN or infinity"):
        gae([0.0, math.nan], [0.0, 0.0], gamma=1.0, lam=1.0)


def test_whitening_spans_every_token_of_the_step():
    # mean 2, unbiased std 1
    assert whiten_tokens([[1.0, 2.0], [3.0]]) == [pytest.approx([-1.0, 0.0]), pytest.approx([1.0])]
    assert whiten_tokens([[0.5, 0.5], [0.5]]) == [[0.0, 0.0], [0.0]]  # nothing to learn from
    assert whiten_tokens([[4.0]]) == [[0.0]]


def test_explained_variance():
    returns = [1.0, 0.0, 1.0, 0.0]
    assert explained_variance(returns, returns) == pytest.approx(1.0)
    assert explained_variance([0.5] * 4, returns) == pytest.approx(0.0)  # a constant at the mean
    assert explained_variance([0.0, 1.0, 0.0, 1.0], returns) < 0  # worse than a constant
    assert math.isnan(explained_variance([0.0, 1.0], [1.0, 1.0]))
