"""Loss functions of RL post-training, as plain torch over response tokens.

Every per-token tensor is `[B, T]` (B sequences, T response positions) with a `mask` `[B, T]`
that is 1 where a token counts; logits are `[B, T, V]`. Nothing here knows about models,
optimizers or the wire, so the torch and megatron backends share it. Conventions follow verl:
PPO-clip with asymmetric clip range, KL estimators k1/k2/k3/low_var_kl, three loss
aggregations, and a log-ratio clamped to [-20, 20] before `exp` for numerical safety.
"""

from __future__ import annotations

import functools

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
CORRECTIONS = ("none", "tis", "decoupled")  # off-policy corrections (`off_policy_weights`)
_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: large enough to never bind in healthy training
_LOW_VAR_KL_CLAMP = 10.0


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] per position: [B, T, V], [B, T] -> [B, T].

    Computed as `logit[target] - logsumexp(logits)` so no [B, T, V] log-probability tensor is
    kept for backward. Half-precision logits are processed one sequence at a time in float32,
    because logsumexp over a large vocabulary in bf16 loses the precision the ratio needs.
    """
    _same_shape(targets, logits.shape[:-1], "targets", "logits[..., 0]")
    if logits.dtype in (torch.float32, torch.float64):
        return _logprobs(logits, targets)
    if logits.is_cuda:  # one fused pass in float32 registers: no float32 copy of the logits, forward or backward
        return _fused_logprobs()(logits, targets)
    rows = []
    for row_logits, row_targets in zip(logits, targets):  # [T, V], [T]
        row_logprobs = torch.log_softmax(row_logits.float(), dim=-1)  # [T, V], one row at a time
        rows.append(row_logprobs.gather(-1, row_targets.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def _logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)


@functools.cache
def _fused_logprobs():
    """`_logprobs` through torch.compile: the upcast folds into the reductions, and backward
    recomputes the softmax from the half-precision logits (about 30 GB less memory traffic a
    step for 16k tokens over a 152k vocabulary)."""
    return torch.compile(_logprobs, dynamic=None)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: [B, T, V] -> [B, T] (in float32 or better)."""
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    probs = torch.softmax(logits, dim=-1)  # [B, T, V]
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token logprobs: [B, T] -> [B, T].

    k1 = logp - ref;  k2 = (logp - ref)^2 / 2;  k3 = exp(ref - logp) - (ref - logp) - 1;
    low_var_kl = k3 with the log-ratio clamped to [-20, 20] and the result to [-10, 10] (verl).
    """
    _same_shape(ref_logprobs, logprobs.shape, "ref_logprobs", "logprobs")
    log_ratio = logprobs - ref_logprobs  # [B, T]
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    if estimator == "low_var_kl":
        reverse = (-log_ratio).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # ref - logp
        return (torch.exp(reverse) - reverse - 1).clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
    raise ValueError(f"kl_estimator: unknown estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar over the masked tokens.

    token_mean: mean over all counted tokens of the batch.
    seq_mean_token_sum: per-sequence sum, averaged over the B sequences.
    seq_mean_token_mean: per-sequence mean, averaged over the B sequences.
    Every row counts as a sequence (a row with no counted tokens adds 0), so a trainer that
    splits a batch into micro-batches can weight each by its number of rows. Masked positions
    never leak in, even as NaN.
    """
    _same_shape(mask, loss_mat.shape, "mask", "loss")
    keep = mask.bool()
    masked = torch.where(keep, loss_mat, torch.zeros_like(loss_mat))  # [B, T]
    counts = keep.sum(dim=-1).to(loss_mat.dtype)  # [B]
    if mode == "token_mean":
        return masked.sum() / counts.sum().clamp(min=1)
    if mode == "seq_mean_token_sum":
        return masked.sum(dim=-1).mean()
    if mode == "seq_mean_token_mean":
        return (masked.sum(dim=-1) / counts.clamp(min=1)).mean()
    raise ValueError(f"loss_agg: unknown mode {mode!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    agg: str = "token_mean",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip policy loss: mean of -min(ratio * A, clip(ratio, 1 - low, 1 + high) * A).

    advantages is [B, T] or [B] (one per sequence, spread over its tokens). `token_weights`
    [B, T] (detached), where given, scale each token's term (off-policy importance weights,
    `off_policy_weights`). Returns the scalar loss and detached scalar metrics over counted
    tokens: clip_frac (share of tokens where the clipped term binds), approx_kl (mean old - new
    logprob, k1 of KL(old || new)) and ratio_mean.
    """
    _same_shape(old_logprobs, logprobs.shape, "old_logprobs", "logprobs")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)  # [B] -> [B, T]
    _same_shape(advantages, logprobs.shape, "advantages", "logprobs")
    log_ratio = (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)  # [B, T]
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)
    loss_mat = torch.maximum(unclipped, clipped)  # the pessimistic (larger) loss
    if token_weights is not None:
        _same_shape(token_weights, logprobs.shape, "token_weights", "logprobs")
        loss_mat = loss_mat * token_weights
    loss = aggregate(loss_mat, mask, agg)
    with torch.no_grad():
        metrics = {
            "clip_frac": _masked_mean((clipped > unclipped).to(logprobs.dtype), mask),
            "approx_kl": _masked_mean(-log_ratio, mask),
            "ratio_mean": _masked_mean(ratio, mask),
        }
    return loss, metrics


def off_policy_weights(
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    correction: str,
    cap: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights w = pi_prox / pi_behav per token [B, T] (detached), for samples drawn
    by older weights (`behaviour`: the engine's logprobs of the tokens it sampled) and trained
    against the trainer's weights before this step (`proximal`). PPO's ratio is then taken
    against `proximal`, and each token's loss is scaled by:

    - `tis` (truncated importance sampling, as verl and slime): min(w, cap).
    - `decoupled` (decoupled PPO, as AReaL): w, and 0 for a token whose w exceeds `cap` (cap <= 0:
      no cap): such a token is left out rather than counted at the cap.

    Metrics over counted tokens: is_weight_mean, is_weight_max (of w before the cap), and
    is_capped_frac (share of tokens the cap changed).
    """
    if correction not in CORRECTIONS[1:]:
        raise ValueError(f"correction: unknown {correction!r}; expected one of {', '.join(CORRECTIONS[1:])}")
    _same_shape(behaviour, proximal.shape, "behaviour", "proximal")
    w = torch.exp((proximal - behaviour).detach().clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    over = w > cap if cap > 0 else torch.zeros_like(w, dtype=torch.bool)
    if correction == "tis":
        weights = w.clamp(max=cap) if cap > 0 else w
    else:
        weights = torch.where(over, torch.zeros_like(w), w)
    keep = mask.bool()
    metrics = {
        "is_weight_mean": _masked_mean(w, mask),
        "is_weight_max": w[keep].max() if bool(keep.any()) else w.new_zeros(()),
        "is_capped_frac": _masked_mean(over.to(w.dtype), mask),
    }
    return weights, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float,
    agg: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO's critic): 0.5 * max((V - R)^2, (clip(V, V_old +- c) - R)^2).

    `value_clip` 0 leaves the values unclipped (plain 0.5 * (V - R)^2). Returns the aggregated
    scalar and detached metrics over counted tokens: value_clip_frac (share of tokens where the
    clipped term is the larger one) and values_mean.
    """
    _same_shape(old_values, values.shape, "old_values", "values")
    _same_shape(returns, values.shape, "returns", "values")
    unclipped = (values - returns).square()
    if value_clip > 0:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (clipped_values - returns).square()
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
    else:
        clipped = unclipped
        loss_mat = 0.5 * unclipped
    loss = aggregate(loss_mat, mask, agg)
    with torch.no_grad():
        metrics = {
            "value_clip_frac": _masked_mean((clipped > unclipped).to(values.dtype), mask),
            "values_mean": _masked_mean(values, mask),
        }
    return loss, metrics


def sft_loss(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, agg: str = "token_mean") -> torch.Tensor:
    """Token cross-entropy of the targets under logits at response positions, aggregated."""
    return aggregate(-gather_logprobs(logits, targets), mask, agg)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    keep = mask.bool()
    return torch.where(keep, values, torch.zeros_like(values)).sum() / keep.sum().clamp(min=1)


def _same_shape(tensor: torch.Tensor, shape: torch.Size, name: str, other: str) -> None:
    if tensor.shape != shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match {other} {tuple(shape)}")


def logprob_gap(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max |trainer - engine| logprob over response tokens [B, T] (the on-policy gap)."""
    _same_shape(engine_logprobs, logprobs.shape, "engine_logprobs", "logprobs")
    gap = (logprobs.float() - engine_logprobs.float()).abs()
    real = mask.bool()
    if not bool(real.any()):
        return {"rollout_logprob_gap_mean": 0.0, "rollout_logprob_gap_max": 0.0}
    return {"rollout_logprob_gap_mean": float(gap[real].mean()), "rollout_logprob_gap_max": float(gap[real].max())}
