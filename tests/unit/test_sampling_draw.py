"""The draw behind every sampled token (`services.rollout.builtin.sampling`): the first token
whose running sum of weights passes u times the total, u from a (row key, step) hash. Tokens are
drawn as often as the softmax says, never for their place at either end of the vocabulary, and
never when top-k or top-p dropped them."""

from __future__ import annotations

import math

import torch

from services.rollout.builtin import sampling

# Row keys whose draw at step 0 has the smallest and the largest 24-bit u (found by a search).
KEY_LOWEST_U, KEY_HIGHEST_U = 0, 27206443


def test_u_is_strictly_inside_zero_one_at_both_ends_of_the_hash():
    steps = torch.zeros(2, dtype=torch.int32)
    u = sampling.uniform(torch.tensor([KEY_LOWEST_U, KEY_HIGHEST_U]), steps)
    assert float(u[0]) == 0.5 / 2**24 and float(u[1]) == 1 - 0.5 / 2**24


def test_draws_follow_the_softmax_of_the_scaled_logits():
    logits = torch.tensor([[2.0, 0.5, -1.0, 1.5, float("-inf"), 0.0]])
    inv_temperature = torch.tensor([1 / 0.7])
    draws = 40_000
    keys = torch.full((draws,), 12345, dtype=torch.int64)
    steps = torch.arange(draws, dtype=torch.int32)
    tokens, logprobs = sampling.sample(logits.expand(draws, -1), keys, steps, inv_temperature, greedy=False)
    expected = torch.softmax(logits[0] / 0.7, dim=-1)
    counts = torch.bincount(tokens, minlength=6).double()
    assert int(counts[4]) == 0  # the -inf token
    for token in (0, 1, 2, 3, 5):
        p = float(expected[token])
        sigma = math.sqrt(draws * p * (1 - p))
        assert abs(float(counts[token]) - draws * p) < 5 * sigma, (token, float(counts[token]), draws * p)
    # the logprob is of the raw logits, whatever the temperature
    assert torch.allclose(logprobs, torch.log_softmax(logits[0], dim=-1)[tokens])


def test_the_extreme_u_draws_neither_a_negligible_first_token_nor_a_dropped_last_one():
    scores = torch.zeros(2, 32)
    scores[:, 0] = -40.0  # probability ~1e-19, first in the running sum
    scores[:, -5:] = float("-inf")  # dropped by top-k / top-p, last in it
    u = sampling.uniform(torch.tensor([KEY_LOWEST_U, KEY_HIGHEST_U]), torch.zeros(2, dtype=torch.int32))
    tokens = sampling.draw(scores, u)
    assert tokens.tolist() == [1, 26]


def test_a_rows_draw_depends_on_its_key_and_step_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=gen) * 3
    keys = torch.randint(0, 2**32, (8,), generator=gen)
    steps = torch.randint(0, 100, (8,), generator=gen, dtype=torch.int32)
    inv_temperature = torch.tensor([1.0])
    together, _ = sampling.sample(logits, keys, steps, inv_temperature, greedy=False)
    alone = [int(sampling.sample(logits[i : i + 1], keys[i : i + 1], steps[i : i + 1], inv_temperature, False)[0])
             for i in range(8)]
    assert together.tolist() == alone
    later, _ = sampling.sample(logits, keys, steps + 1, inv_temperature, greedy=False)
    assert later.tolist() != together.tolist()  # another step, other draws (8 rows of 1000 tokens)
