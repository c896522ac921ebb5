"""Sampling on the device, one row at a time and independent of how rows are batched.

A row draws its next token by the Gumbel-max rule: argmax over the vocabulary of
`logits / temperature + g`, with g = -log(-log(u)) and u a uniform number made by hashing
(row key, step, token id). That is an exact draw from softmax(logits / temperature), it needs no
generator state, so it can live inside a CUDA graph, and a row's draws depend only on its own
key: the same seed gives the same samples however rows are batched, admitted or compacted.
Top-k and top-p mask the scaled logits first (the masked tokens can never win the argmax).

The logprob returned is always log_softmax of the raw logits at the chosen token (see
`services.rollout.types`). `sample` here is the torch version; `kernels.sample` computes the same
draw in one pass over the logits on a GPU.
"""

from __future__ import annotations

import hashlib

import torch

MASK32 = 0xFFFFFFFF
HASH_MUL = 0x45D9F3B  # small enough that products of 32-bit values stay inside int64
STEP_MUL = 0x9E3779B9
TOKEN_MUL = 0x2545F491


def row_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 32-bit key of one sample's draws: a function of the call's seed and its place only."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 values in [0, 2**32) (the kernel does the same in uint32)."""
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    return (x >> 16) ^ x


def uniforms(keys: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1), float32 [b, V], for int64 keys [b] and steps [b]."""
    step_keys = hash32((keys + steps.long() * STEP_MUL) & MASK32)  # [b]
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64) * TOKEN_MUL  # [V]
    bits = hash32((step_keys[:, None] + tokens[None, :]) & MASK32)  # [b, V]
    return ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))


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
    as the quantity the noise is added to; `greedy` (temperature 0) takes the argmax of the raw
    logits instead."""
    raw = logits.float()
    lse = torch.logsumexp(raw, dim=-1)  # [b]
    if greedy:
        tokens = raw.argmax(dim=-1)
    else:
        if scores is None:
            scores = raw * inv_temperature
        gumbel = -torch.log(-torch.log(uniforms(keys, steps, raw.shape[-1])))  # [b, V]
        tokens = (scores + gumbel).argmax(dim=-1)  # [b]
    return tokens, raw.gather(1, tokens[:, None]).squeeze(1) - lse
