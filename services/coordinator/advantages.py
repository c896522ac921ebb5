"""Advantage estimators over outcome rewards grouped per prompt.

Every estimator takes `rewards: FloatTensor[num_prompts, n]` (n samples per prompt, one scalar
reward per completion) and returns advantages of the same shape; the trainer spreads a
sequence's advantage over its response tokens. Conventions follow verl:

- GRPO: `(r - mean_group) / (std_group + eps)` with torch's default *unbiased* std over the
  group (verl's `torch.std`), eps 1e-6.
- Dr. GRPO: `r - mean_group`, no std division (removes GRPO's difficulty bias).
- REINFORCE++: no group baseline; returns are whitened over the whole batch,
  `(r - mean_batch) / (std_batch + eps)`, unbiased std, eps 1e-8. verl whitens over response
  tokens, which weighs long responses more; here every sequence counts once.
- REINFORCE++ with baseline: subtract the group mean, then whiten over the batch.

With a group baseline, a group whose rewards are all equal carries no signal and gets exactly 0
(never NaN, never the float dust that `(r - mean) / eps` would amplify); plain REINFORCE++ has
no groups, so there only an all-equal batch gets 0.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

GRPO_EPS = 1e-6
WHITEN_EPS = 1e-8


def grpo(rewards: torch.Tensor, normalize_std: bool = True, eps: float = GRPO_EPS) -> torch.Tensor:
    """GRPO: group-mean baseline, optionally scaled by the group's (unbiased) std."""
    rewards = _check(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [P, n]
    if normalize_std:
        centred = centred / (_group_std(rewards) + eps)
    return _zero_flat_groups(centred, rewards)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: group-mean baseline without std normalisation."""
    rewards = _check(rewards)
    return _zero_flat_groups(rewards - rewards.mean(dim=1, keepdim=True), rewards)


def reinforce_pp(rewards: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """REINFORCE++: global batch whitening of the returns, no group baseline."""
    rewards = _check(rewards)
    # No group baseline here: a flat group still has a signal against the batch mean, so only a
    # flat *batch* is zeroed (a group of one sample is always "flat").
    flat_batch = (rewards == rewards.flatten()[0]).all()
    return torch.zeros_like(rewards) if flat_batch else _whiten(rewards, eps)


def reinforce_pp_baseline(rewards: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """REINFORCE++ with baseline: subtract the group mean, then whiten over the batch."""
    rewards = _check(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [P, n]
    return _zero_flat_groups(_whiten(centred, eps), rewards)


ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "reinforce_pp": reinforce_pp,
    "reinforce_pp_baseline": reinforce_pp_baseline,
}


def compute_advantages(kind: str, rewards: torch.Tensor | Sequence[Sequence[float]], **opts: float) -> torch.Tensor:
    """Dispatch to the estimator named `kind`; `normalize_std` is ignored by all but grpo."""
    if kind == "ppo":
        raise ValueError("algorithm.advantage: 'ppo' advantages are per token, from a critic's values: use gae()")
    if kind not in ESTIMATORS:
        raise ValueError(f"algorithm.advantage: unknown estimator {kind!r}; expected one of {', '.join(ESTIMATORS)}")
    if kind != "grpo":
        opts.pop("normalize_std", None)  # one call site can pass the job's setting for every kind
    return ESTIMATORS[kind](torch.as_tensor(rewards), **opts)


def _check(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.dim() != 2 or rewards.numel() == 0:
        raise ValueError(f"rewards: expected a non-empty [num_prompts, n] tensor, got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards: contains NaN or infinity")
    return rewards


def _group_std(rewards: torch.Tensor) -> torch.Tensor:
    if rewards.shape[1] < 2:  # the unbiased std of one sample is NaN; such groups are flat anyway
        return torch.zeros_like(rewards[:, :1])
    return rewards.std(dim=1, keepdim=True)  # [P, 1], unbiased


def _whiten(values: torch.Tensor, eps: float) -> torch.Tensor:
    std = values.std() if values.numel() > 1 else torch.zeros((), dtype=values.dtype)
    return (values - values.mean()) / (std + eps)


def _zero_flat_groups(advantages: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    flat = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)  # [P, 1]
    return torch.where(flat, torch.zeros_like(advantages), advantages)


# ---- PPO: generalised advantage estimation over per-token rewards and a critic's values -------------
def gae(rewards: Sequence[float], values: Sequence[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """GAE for one response of T tokens: (advantages, returns), each T long.

    `rewards[t]` is the reward for emitting token t (the outcome reward on the last token, plus
    any per-token KL penalty) and `values[t]` the critic's V of the state before token t. The
    episode ends after the last token, so V after it is 0:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t          (the critic's regression target)

    With gamma = lam = 1 and a zero critic, every A_t is the sum of the rewards from t on.
    """
    if len(rewards) != len(values):
        raise ValueError(f"gae: {len(rewards)} rewards for {len(values)} values")
    if not all(math.isfinite(x) for x in (*rewards, *values)):
        raise ValueError("gae: rewards or values contain NaN or infinity")
    advantages = [0.0] * len(rewards)
    running, next_value = 0.0, 0.0
    for t in range(len(rewards) - 1, -1, -1):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
        next_value = values[t]
    return advantages, [a + v for a, v in zip(advantages, values)]


def whiten_tokens(advantages: list[list[float]], eps: float = WHITEN_EPS) -> list[list[float]]:
    """Shift and scale every token's advantage of a step to mean 0 and (unbiased) std 1, over all
    tokens together (verl's masked_whiten); one token, or all equal, become 0."""
    flat = torch.tensor([a for row in advantages for a in row], dtype=torch.float64)
    if flat.numel() < 2 or bool((flat == flat[0]).all()):
        return [[0.0] * len(row) for row in advantages]
    whitened = ((flat - flat.mean()) / (flat.std() + eps)).tolist()
    out, start = [], 0
    for row in advantages:
        out.append(whitened[start : start + len(row)])
        start += len(row)
    return out


def explained_variance(values: Sequence[float], returns: Sequence[float]) -> float:
    """1 - Var(returns - values) / Var(returns) over tokens: 1 is a perfect critic, 0 one no better
    than a constant, below 0 worse; NaN when the returns do not vary."""
    v = torch.tensor(list(values), dtype=torch.float64)
    r = torch.tensor(list(returns), dtype=torch.float64)
    if r.numel() < 2 or float(r.var()) == 0.0:
        return float("nan")
    return float(1.0 - (r - v).var() / r.var())
