"""Sampling on the device, one row at a time and independent of how rows are batched.

A row draws its next token by the Gumbel-max rule: argmax over the vocabulary of
`logits / temperature + g`, with g = -log(-log(u)) and u a uniform number in (0, 1) made by
hashing (row key, step, token id) to 24 bits (`gumbel` says how g stays finite and exact).
That is an exact draw from softmax(logits / temperature), it needs no
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


def uniform_bits(keys: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """24 random bits per token, int64 [b, V] in [0, 2**24), for int64 keys [b] and steps [b]:
    u = (bits + 1/2) / 2**24."""
    step_keys = hash32((keys + steps.long() * STEP_MUL) & MASK32)  # [b]
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64) * TOKEN_MUL  # [V]
    return hash32((step_keys[:, None] + tokens[None, :]) & MASK32) >> 8  # [b, V]


def gumbel(bits: torch.Tensor) -> torch.Tensor:
    """g = -log(-log u), float32, for u = (bits + 1/2) / 2**24 (`uniform_bits`).

    The largest g come from u near 1, where -log u is small: it must be computed from 1 - u
    (exact there), not from u, which float32 rounds (bits + 1/2 needs 25 bits past 2**23) and
    rounds to exactly 1 for the top value, making g infinite. That top value comes up once in
    2**24 tokens, 0.9% of the draws over a 151,936-token vocabulary: each such draw took that
    token whatever its probability. Below u = 1/2, u is exact and -log u is taken from it."""
    u = (bits.float() + 0.5) * (1.0 / (1 << 24))  # exact below 1/2
    w = ((((1 << 24) - 1) - bits).float() + 0.5) * (1.0 / (1 << 24))  # 1 - u, exact above 1/2
    neg_log_u = torch.where(bits < (1 << 23), -torch.log(u), -torch.log1p(-w))
    return -torch.log(neg_log_u)


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
        noise = gumbel(uniform_bits(keys, steps, raw.shape[-1]))  # [b, V]
        tokens = (scores + noise).argmax(dim=-1)  # [b]
    return tokens, raw.gather(1, tokens[:, None]).squeeze(1) - lse
