"""Turn a list of samples (prompt + response + per-token RL data) into padded training tensors.

Logits at position t predict token t+1, so every per-token tensor here is laid over the T-1
"next token" positions of the concatenated sequence: response token k of a sample whose prompt
has P tokens sits at position P - 1 + k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, kw_only=True)
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[float] = field(default_factory=list)     # empty = all ones
    advantages: list[float] = field(default_factory=list)    # per response token
    old_logprobs: list[float] = field(default_factory=list)  # empty = current policy, detached
    ref_logprobs: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)       # value loss: targets per response token
    old_values: list[float] = field(default_factory=list)    # value loss: the values behind `returns`


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor       # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T] 1 = real token
    targets: torch.Tensor         # [B, T-1] next tokens
    response_mask: torch.Tensor   # [B, T-1] float, loss mask on response positions
    advantages: torch.Tensor      # [B, T-1]
    old_logprobs: torch.Tensor | None  # [B, T-1]
    ref_logprobs: torch.Tensor | None  # [B, T-1]
    num_response_tokens: list[int]
    returns: torch.Tensor | None = None     # [B, T-1]
    old_values: torch.Tensor | None = None  # [B, T-1]

    def response_values(self, values: torch.Tensor) -> list[list[float]]:
        """Per-sample lists of `values` [B, T-1] at the response positions, in order."""
        out = []
        for row, (start, n) in enumerate(self._spans()):
            out.append(values[row, start : start + n].tolist())
        return out

    def _spans(self) -> list[tuple[int, int]]:
        lengths = self.attention_mask.sum(dim=1).tolist()
        return [(int(length) - n - 1, n) for length, n in zip(lengths, self.num_response_tokens)]


def _check_sample(index: int, sample: Sample) -> None:
    """Lengths agree and every number is finite: one NaN advantage would make every weight NaN,
    and the next sync would ship them to the engines."""
    n = len(sample.response_ids)
    if not sample.prompt_ids:
        raise ValueError(f"batch.samples[{index}].prompt_ids: empty")
    if n == 0:
        raise ValueError(f"batch.samples[{index}].response_ids: empty")
    for name in ("loss_mask", "advantages", "old_logprobs", "ref_logprobs", "returns", "old_values"):
        values = getattr(sample, name)
        if values and len(values) != n:
            raise ValueError(
                f"batch.samples[{index}].{name}: has {len(values)} values for {n} response tokens"
            )
        bad = next((k for k, v in enumerate(values) if not math.isfinite(v)), None)
        if bad is not None:
            raise ValueError(f"batch.samples[{index}].{name}[{bad}]: {values[bad]} is not a finite number")
    if any(v < 0 for v in sample.loss_mask):
        raise ValueError(f"batch.samples[{index}].loss_mask: weights must be >= 0")


def pack(samples: list[Sample], *, pad_id: int, vocab_size: int, device: torch.device | str) -> PackedBatch:
    if not samples:
        raise ValueError("batch.samples: empty batch")
    for i, s in enumerate(samples):
        _check_sample(i, s)
        bad = [t for t in (*s.prompt_ids, *s.response_ids) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"batch.samples[{i}]: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    max_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, max_len), dtype=torch.long)
    response_mask = torch.zeros((b, max_len - 1))
    advantages = torch.zeros((b, max_len - 1))
    has_old = all(s.old_logprobs for s in samples)
    has_ref = all(s.ref_logprobs for s in samples)
    old = torch.zeros((b, max_len - 1)) if has_old else None
    ref = torch.zeros((b, max_len - 1)) if has_ref else None
    returns = torch.zeros((b, max_len - 1)) if all(s.returns for s in samples) else None
    old_values = torch.zeros((b, max_len - 1)) if all(s.old_values for s in samples) else None
    for row, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.response_ids)
        input_ids[row, : p + n] = torch.tensor(s.prompt_ids + s.response_ids)
        attention_mask[row, : p + n] = 1
        span = slice(p - 1, p - 1 + n)
        response_mask[row, span] = torch.tensor(s.loss_mask) if s.loss_mask else 1.0
        if s.advantages:
            advantages[row, span] = torch.tensor(s.advantages)
        if old is not None:
            old[row, span] = torch.tensor(s.old_logprobs)
        if ref is not None:
            ref[row, span] = torch.tensor(s.ref_logprobs)
        if returns is not None:
            returns[row, span] = torch.tensor(s.returns)
        if old_values is not None:
            old_values[row, span] = torch.tensor(s.old_values)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return PackedBatch(
        input_ids=move(input_ids),
        attention_mask=move(attention_mask),
        targets=move(input_ids[:, 1:].contiguous()),
        response_mask=move(response_mask),
        advantages=move(advantages),
        old_logprobs=move(old),
        ref_logprobs=move(ref),
        num_response_tokens=[len(s.response_ids) for s in samples],
        returns=move(returns),
        old_values=move(old_values),
    )


def micro_batches(samples: list[Sample], size: int) -> list[list[Sample]]:
    return [samples[i : i + size] for i in range(0, len(samples), size)]
