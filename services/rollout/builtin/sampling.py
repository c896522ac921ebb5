"""Sampling on the device, one row at a time and independent of how rows are batched.

A row draws its next token by inverting its distribution's cumulative sum: with weights
w = exp(score - max score) over the vocabulary in token order (score = logits / temperature),
it takes the first token whose running sum of weights passes u times their total, u a uniform
number in (0, 1) made by hashing (row key, step) to 24 bits. That is an exact draw from
softmax(logits / temperature), as far as the sums' rounding goes: it needs no generator state,
so it can live inside a CUDA graph, and a row's draws depend only on its own key: the same seed
gives the same samples however rows are batched, admitted or compacted. Top-k and top-p set the
scores of the tokens they drop to -inf first: weight 0, never drawn.

Why not Gumbel-max (argmax of score + -log(-log u_token)): that needs one hash and two
logarithms per token of the vocabulary, and on an H200 at a batch of 256 its kernel took 86 us
a decode step, bound by those instructions, not by the logits' bytes. The draw by cumulative
sums costs one exponential per token and one hash per row (31 + 8 us there).

The logprob returned is always log_softmax of the raw logits at the chosen token (see
`services.rollout.types`). `sample` here is the torch version, summing in float64; the GPU
kernel (`kernels.sample`) sums in float32, by vocabulary chunks of `CHUNK` tokens, so its
draw can differ from this one only where u times the total falls within float32 rounding of a
boundary between two tokens' shares.
"""

from __future__ import annotations

import hashlib

import torch

CHUNK = 4096  # vocabulary tokens a GPU program sums (fixed: a row's sums, and so its draws, never depend on the batch)
MASK32 = 0xFFFFFFFF
HASH_MUL = 0x45D9F3B  # small enough that products of 32-bit values stay inside int64
STEP_MUL = 0x9E3779B9


def row_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 32-bit key of one sample's draws: a function of the call's seed and its place only."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 values in [0, 2**32) (the kernel does the same in uint32)."""
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    return (x >> 16) ^ x


def uniform(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """u in (0, 1), float64 [b], for int64 keys [b] and steps [b]: the top 24 bits of the
    (key, step) hash, u = (bits + 1/2) / 2**24, so u * total < total always."""
    bits = hash32((keys + steps.long() * STEP_MUL) & MASK32) >> 8
    return (bits.double() + 0.5) / (1 << 24)


def draw(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Tokens int64 [b]: for each row of scores [b, V], the first token whose running sum of
    weights exp(score - max) passes u [b] times the row's total. A token of weight 0 (score
    -inf) is never the first to pass it."""
    scores = scores.double()
    weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    running = weights.cumsum(dim=-1)
    target = u.to(running.device) * running[:, -1]
    return (running <= target[:, None]).sum(dim=-1)


def filter_scores(logits: torch.Tensor, inv_temperature: torch.Tensor, top_k: int,
                  top_p: torch.Tensor | None) -> torch.Tensor:
    """float32 logits [b, V] scaled by 1/temperature, with tokens outside top-k / top-p at -inf.
    `top_p` is a device scalar (None: no top-p), so one captured graph serves any value."""
    scores = logits.float() * inv_temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # [b, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None:
        ordered, order = scores.sort(dim=-1, descending=True)  # [b, V]
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the top token has 0 and always stays
        drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(1, order, mass_before >= top_p)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample(logits: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor, inv_temperature: torch.Tensor,
           greedy: bool, scores: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens int64 [b] and their raw logprobs float32 [b] from logits [b, V].

    `scores` (already scaled and filtered, from `filter_scores`) replace logits * inv_temperature
    as the draw's scores; `greedy` (temperature 0) takes the argmax of the raw
    logits instead."""
    raw = logits.float()
    lse = torch.logsumexp(raw, dim=-1)  # [b]
    if greedy:
        tokens = raw.argmax(dim=-1)
    else:
        if scores is None:
            scores = raw * inv_temperature
        tokens = draw(scores, uniform(keys, steps))
    return tokens, raw.gather(1, tokens[:, None]).squeeze(1) - lse
