"""The Gumbel noise behind every sampled token (`services.rollout.builtin.sampling`): finite and
exact for every 24-bit draw, so a token is drawn only as often as its probability says."""

from __future__ import annotations

import torch

from services.rollout.builtin import sampling

TOP = (1 << 24) - 1
# A row key whose draw at step 0 gives token 20 the top 24-bit value (found by a search over keys).
KEY, TOKEN = 1201460, 20


def test_the_noise_of_every_24_bit_value_is_finite_and_within_1e6_of_exact():
    bits = torch.arange(1 << 24)
    noise = sampling.gumbel(bits).double()
    u = (bits.double() + 0.5) / 2**24
    exact = -torch.log(-torch.log(u))
    assert bool(torch.isfinite(noise).all())
    assert float((noise - exact).abs().max()) < 1e-6


def test_a_token_of_negligible_probability_is_not_drawn_when_its_hash_is_the_top_value():
    """Rounding u to 1 made this token's noise infinite: it was drawn whatever its logit, which
    happened for 0.9% of the draws over a 151,936-token vocabulary."""
    keys, steps = torch.tensor([KEY]), torch.tensor([0], dtype=torch.int32)
    assert int(sampling.uniform_bits(keys, steps, 32)[0, TOKEN]) == TOP
    logits = torch.zeros(1, 32)
    logits[0, TOKEN] = -40.0  # probability ~1e-19
    tokens, logprobs = sampling.sample(logits, keys, steps, torch.tensor([1.0]), greedy=False)
    assert int(tokens[0]) != TOKEN and float(logprobs[0]) > -5
