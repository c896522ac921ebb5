"""Loss functions: hand-computed values, estimator formulas, clipping and gradient direction."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.losses import (
    aggregate,
    entropy_from_logits,
    gather_logprobs,
    kl_penalty,
    off_policy_weights,
    policy_loss,
    sft_loss,
)


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


# --------------------------------------------------------------------------- logprobs and entropy


def test_gather_logprobs_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7)  # [B, T, V]
    targets = torch.randint(0, 7, (2, 3))  # [B, T]
    expected = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    close(gather_logprobs(logits, targets), expected)


def test_gather_logprobs_of_bf16_logits_is_computed_in_float32():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 50).bfloat16()
    targets = torch.randint(0, 50, (2, 3))
    out = gather_logprobs(logits, targets)
    assert out.dtype == torch.float32
    close(out, gather_logprobs(logits.float(), targets))


def test_gather_logprobs_checks_shapes():
    with pytest.raises(ValueError, match="targets"):
        gather_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_from_logits():
    uniform = torch.zeros(1, 2, 8)
    close(entropy_from_logits(uniform), [[math.log(8), math.log(8)]])
    peaked = torch.tensor([[[100.0, 0.0, 0.0]]])
    close(entropy_from_logits(peaked), [[0.0]])
    logits = torch.tensor([[[1.0, 2.0, 0.5]]])
    p = torch.softmax(logits, dim=-1)
    close(entropy_from_logits(logits), -(p * p.log()).sum(-1))


# --------------------------------------------------------------------------- KL estimators


def test_kl_estimators_follow_their_formulas():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])  # logp - ref = [0.5, -1.0]
    close(kl_penalty(logp, ref, "k1"), [[0.5, -1.0]])
    close(kl_penalty(logp, ref, "k2"), [[0.125, 0.5]])
    k3 = [[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]]  # exp(ref - logp) - (ref - logp) - 1
    close(kl_penalty(logp, ref, "k3"), k3)
    close(kl_penalty(logp, ref, "low_var_kl"), k3)


def test_low_var_kl_is_clamped_and_k3_is_not():
    logp, ref = torch.tensor([[-31.0]]), torch.tensor([[-1.0]])  # ref - logp = 30
    close(kl_penalty(logp, ref, "low_var_kl"), [[10.0]])
    assert kl_penalty(logp, ref, "k3").item() > 1e12


def test_k3_is_never_negative_and_zero_when_equal():
    torch.manual_seed(0)
    logp, ref = -torch.rand(4, 6) * 5, -torch.rand(4, 6) * 5
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    close(kl_penalty(ref, ref, "low_var_kl"), torch.zeros(4, 6))


def test_unknown_kl_estimator():
    with pytest.raises(ValueError, match="kl_estimator: unknown estimator 'k4'"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# --------------------------------------------------------------------------- aggregation


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", (1 + 2 + 4) / 3),
        ("seq_mean_token_sum", ((1 + 2) + 4) / 2),
        ("seq_mean_token_mean", ((1 + 2) / 2 + 4) / 2),
    ],
)
def test_aggregate_modes(mode, expected):
    close(aggregate(LOSS, MASK, mode), expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_aggregate_ignores_masked_positions_even_nan(mode):
    poisoned = LOSS.clone()
    poisoned[0, 2] = float("nan")
    poisoned[1, 1] = float("inf")
    close(aggregate(poisoned, MASK.bool(), mode), aggregate(LOSS, MASK, mode))
    assert aggregate(LOSS, torch.zeros_like(MASK), mode).item() == 0.0  # nothing counted: 0, not NaN


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="loss_agg: unknown mode 'mean'"):
        aggregate(LOSS, MASK, "mean")


# --------------------------------------------------------------------------- policy loss


def test_policy_loss_hand_computed():
    ratio = torch.tensor([[1.0, 1.5, 0.5]])
    logprobs, old = ratio.log(), torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, 1.0, -1.0]])
    loss, metrics = policy_loss(logprobs, old, advantages, torch.ones(1, 3), 0.2, 0.2, "token_mean")
    # token 0: -1 * 1 = -1; token 1: max(-1.5, -1.2) = -1.2 (clipped); token 2: max(0.5, 0.8) = 0.8 (clipped)
    close(loss, (-1.0 - 1.2 + 0.8) / 3)
    close(metrics["clip_frac"], 2 / 3)
    close(metrics["ratio_mean"], 1.0)
    close(metrics["approx_kl"], -(math.log(1.5) + math.log(0.5)) / 3)  # mean of old - new
    assert not any(m.requires_grad for m in metrics.values())


def test_policy_loss_asymmetric_clip_range():
    logprobs = torch.tensor([[math.log(1.25)]])
    args = (torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    close(policy_loss(logprobs, *args, 0.2, 0.2)[0], -1.2)  # clipped at 1 + 0.2
    close(policy_loss(logprobs, *args, 0.2, 0.28)[0], -1.25)  # clip-higher leaves it alone


def test_policy_loss_takes_one_advantage_per_sequence():
    torch.manual_seed(0)
    logprobs, old = -torch.rand(2, 4), -torch.rand(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    per_sequence = torch.tensor([0.5, -2.0])
    expanded = per_sequence.unsqueeze(-1).expand(2, 4)
    close(
        policy_loss(logprobs, old, per_sequence, mask, 0.2, 0.2)[0],
        policy_loss(logprobs, old, expanded, mask, 0.2, 0.2)[0],
    )


@pytest.mark.parametrize(("ratio", "advantage"), [(1.5, 1.0), (0.5, -1.0)])
def test_clipped_tokens_get_no_gradient(ratio, advantage):
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, metrics = policy_loss(logprobs, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), 0.2, 0.2)
    loss.backward()
    assert logprobs.grad.item() == 0.0
    assert metrics["clip_frac"].item() == 1.0


def test_unclipped_tokens_get_the_policy_gradient():
    logprobs = torch.tensor([[math.log(1.1)]], requires_grad=True)
    loss, _ = policy_loss(logprobs, torch.zeros(1, 1), torch.tensor([[2.0]]), torch.ones(1, 1), 0.2, 0.2)
    loss.backward()
    close(logprobs.grad, [[-2.0 * 1.1]])  # d(-A * exp(logp - old)) / dlogp


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_sgd_step_moves_the_sampled_token_with_the_advantage(advantage):
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 6, requires_grad=True)  # [B, T, V]: a stand-in for a policy's output
    targets = torch.randint(0, 6, (1, 4))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    before = gather_logprobs(logits, targets).detach()
    loss, _ = policy_loss(gather_logprobs(logits, targets), before, torch.full((1, 4), advantage), mask, 0.2, 0.2)
    loss.backward()
    with torch.no_grad():
        logits -= 0.5 * logits.grad
    change = gather_logprobs(logits, targets).detach() - before
    assert (torch.sign(change[mask.bool()]) == math.copysign(1, advantage)).all()
    assert change[0, 3] == 0  # the masked position is untouched


# --------------------------------------------------------------------------- SFT


def test_sft_loss_is_token_cross_entropy():
    logits = torch.zeros(2, 3, 5)  # uniform: every target costs log 5
    targets = torch.zeros(2, 3, dtype=torch.long)
    close(sft_loss(logits, targets, torch.ones(2, 3), "token_mean"), math.log(5))
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    reference = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1), reduction="none")
    close(sft_loss(logits, targets, mask, "token_mean"), (reference * mask.reshape(-1)).sum() / mask.sum())


def test_sft_step_lowers_the_loss():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3))
    mask = torch.ones(2, 3)
    loss = sft_loss(logits, targets, mask, "seq_mean_token_mean")
    loss.backward()
    with torch.no_grad():
        logits -= 1.0 * logits.grad
    assert sft_loss(logits, targets, mask, "seq_mean_token_mean") < loss


# --------------------------------------------------------------------------- off-policy correction


def test_truncated_importance_weights_hand_computed():
    """w = exp(proximal - behaviour), truncated at the cap; metrics see w before the cap."""
    behaviour = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.4)]])
    proximal = torch.tensor([[math.log(0.5), math.log(0.6), math.log(0.2)]])  # w = 1, 3, 0.5
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    weights, metrics = off_policy_weights(proximal, behaviour, mask, "tis", 2.0)
    close(weights, [[1.0, 2.0, 0.5]])
    close(metrics["is_weight_mean"], (1 + 3 + 0.5) / 3)
    close(metrics["is_weight_max"], 3.0)
    close(metrics["is_capped_frac"], 1 / 3)


def test_decoupled_weights_leave_out_tokens_over_the_cap():
    behaviour = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.4)]])
    proximal = torch.tensor([[math.log(0.5), math.log(0.6), math.log(0.2)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token does not count
    weights, metrics = off_policy_weights(proximal, behaviour, mask, "decoupled", 2.0)
    close(weights, [[1.0, 0.0, 0.5]])
    close(metrics["is_weight_mean"], 2.0)  # (1 + 3) / 2 over counted tokens
    close(metrics["is_capped_frac"], 0.5)
    uncapped, _ = off_policy_weights(proximal, behaviour, mask, "decoupled", 0.0)
    close(uncapped, [[1.0, 3.0, 0.5]])


def test_weighted_policy_loss_hand_computed():
    """Against the proximal policy the ratio is 1 at the current weights: the loss is
    -mean(w * A), and its gradient is the policy gradient scaled by w."""
    logprobs = torch.tensor([[math.log(0.5), math.log(0.6)]], requires_grad=True)
    advantages = torch.tensor([1.0])
    weights = torch.tensor([[1.0, 2.0]])
    loss, metrics = policy_loss(logprobs, logprobs.detach(), advantages, torch.ones(1, 2), 0.2, 0.2,
                                token_weights=weights)
    close(loss.detach(), -(1.0 * 1 + 2.0 * 1) / 2)
    loss.backward()
    close(logprobs.grad, [[-0.5, -1.0]])  # d/dlogp of -w * A * exp(logp - sg(logp)) / 2
    close(metrics["ratio_mean"], 1.0)


def test_unknown_correction_and_mismatched_shapes_are_named():
    with pytest.raises(ValueError, match="correction"):
        off_policy_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), "bogus", 2.0)
    with pytest.raises(ValueError, match="behaviour"):
        off_policy_weights(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), "tis", 2.0)
