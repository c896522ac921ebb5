"""The built-in engine's prefix cache: prompts that start the same way share the KV blocks of
that start across requests and are prefilled only past it. What a user sees must not change:
the same greedy tokens and (float32) the same logprobs as with no cache, every block back in
the pool or in the cache when nothing runs, old blocks evicted when the pool is needed, and
never a block computed under one weight version used under another."""

from __future__ import annotations

import random

import pytest
import torch

from services.models.decoder import DecoderLM, init_weights
from services.rollout.builtin.prefix_cache import PrefixCache, block_keys
from services.rollout.builtin.kv_cache import BlockAllocator
from services.rollout.engine import RolloutEngine, RolloutSettings
from services.rollout.receiver import Staging
from services.rollout.types import Sampling
from services.weights.apply import named_weights
from tests.unit.test_serving import _teacher_forced, _update

torch.set_num_threads(1)

GREEDY = Sampling(temperature=0.0, max_new_tokens=12, ignore_eos=True)
SEEDED = Sampling(temperature=1.0, max_new_tokens=12, seed=4, n=3, ignore_eos=True)


def _engine(model_dir, prefix_cache: bool, **settings) -> RolloutEngine:
    return RolloutEngine(RolloutSettings(model_path=str(model_dir), load_weights=False, seed=3,
                                         prefix_cache=prefix_cache, **settings))


def _conversations(count: int, system: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing a `system`-token start, then each its own turn of 1-40 tokens."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 17) for _ in range(system)]
    return [head + [rng.randrange(3, 17) for _ in range(rng.randrange(1, 41))] for _ in range(count)]


def _all_blocks_accounted(engine: RolloutEngine) -> bool:
    """Nothing runs: every block is free or held by the cache alone."""
    allocator = engine.core.cache.allocator
    prefix = engine.core.scheduler.prefix
    cached = len(prefix) if prefix is not None else 0
    held_once = prefix.evictable() if prefix is not None else 0
    return allocator.num_free + cached == allocator.num_blocks - 1 and held_once == cached


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded-n3"])
def test_cached_prefixes_give_the_tokens_and_logprobs_of_no_cache(long_model_dir, sampling):
    check_cached_prefixes(long_model_dir, sampling, "cpu", 1e-5)


def check_cached_prefixes(long_model_dir, sampling: Sampling, device: str, tolerance: float) -> None:
    """16 conversations over a 150-token start, asked three times (the second and third find
    it cached, with the first turns too): same tokens, logprobs within `tolerance` (float32)."""
    prompts = _conversations(16, 150)
    off = _engine(long_model_dir, False, device=device)
    on = _engine(long_model_dir, True, device=device)
    try:
        plain = off.generate(prompts, sampling)[0]
        on.generate(prompts[:1], sampling)  # the start is cached ...
        first = on.generate(prompts, sampling)[0]  # ... and these prompts' own blocks, for the next
        again = on.generate(prompts, sampling)[0]
        prefix = on.core.scheduler.prefix
        assert prefix.hit_tokens >= 16 * 2 * 144  # both calls found (at least) the start's 9 blocks
        for results in (first, again):
            assert [g.output_ids for g in results] == [g.output_ids for g in plain]
            for g, p in zip(results, plain):
                assert max(abs(a - b) for a, b in zip(g.logprobs, p.logprobs)) < tolerance
        assert _all_blocks_accounted(on)
    finally:
        off.close()
        on.close()


def test_the_cache_is_read_not_recomputed(long_model_dir):
    """Keys and values of a cached start overwritten with zeros change what comes out: the
    cached blocks are what the prompts' later tokens attend to, not a fresh prefill."""
    prompts = _conversations(6, 100, seed=1)
    engine = _engine(long_model_dir, True)
    try:
        before = engine.generate(prompts, GREEDY)[0]
        blocks = list(engine.core.scheduler.prefix._blocks.values())
        engine.core.cache.kv[:, :, blocks] = 0
        after = engine.generate(prompts, GREEDY)[0]
        assert all(a.logprobs != b.logprobs for a, b in zip(before, after))
    finally:
        engine.close()


def test_a_pool_too_small_for_the_cache_evicts_least_recently_used_blocks(long_model_dir, monkeypatch):
    """A pool of a few rows' blocks: each call's prompts push older cached blocks out (least
    recently used first), every row still finishes with the tokens of no cache, and the start
    that every call uses stays cached."""
    engine = _engine(long_model_dir, True, max_batch_size=4)
    blocks_per_row = engine.core.shape.blocks_for(250 + GREEDY.max_new_tokens)
    monkeypatch.setattr(engine.core, "_cpu_blocks", lambda longest, rows: 4 * blocks_per_row + 1)
    off = _engine(long_model_dir, False)
    start = _conversations(1, 150)[0][:150]
    try:
        for call in range(4):
            rng = random.Random(call)
            prompts = [start + [rng.randrange(3, 17) for _ in range(rng.randrange(40, 101))] for _ in range(4)]
            got = engine.generate(prompts, GREEDY)[0]
            assert [g.output_ids for g in got] == [g.output_ids for g in off.generate(prompts, GREEDY)[0]]
            assert engine.core.cache.num_blocks == 4 * blocks_per_row + 1  # the pool never grew
            assert _all_blocks_accounted(engine)
        prefix = engine.core.scheduler.prefix
        assert all(key in prefix._blocks for key in prefix.keys(start))
        assert prefix.hit_tokens >= 3 * 4 * 144  # calls 2-4 found the start
        assert prefix.evicted > 0
    finally:
        engine.close()
        off.close()


def _other_weights(engine: RolloutEngine, seed: int) -> dict[str, torch.Tensor]:
    """A whole other model (every layer differs: other keys and values for the same prompt)."""
    model = DecoderLM(engine.model_config)
    init_weights(model, seed=seed)
    return {name: t.detach().clone() for name, t in named_weights(model)}


@pytest.mark.parametrize("policy", ["drain", "pause"])
def test_a_weight_update_never_lets_old_keys_and_values_be_reused(long_model_dir, policy):
    """A prompt cached under version 1, asked again after version 2 arrives: its logprobs are
    those version 2's weights give the whole prompt (teacher-forced), not what version 1's
    cached start would give. (Without the cache rule, this fails: the old start is matched.)"""
    prompts = _conversations(4, 120, seed=2)
    engine = _engine(long_model_dir, True)
    staging = Staging(engine.device)
    v1, v2 = _other_weights(engine, 21), _other_weights(engine, 22)
    try:
        _update(engine, staging, v1, 1, "drain")
        engine.generate(prompts, GREEDY)
        assert len(engine.core.scheduler.prefix) > 0
        _update(engine, staging, v2, 2, policy)
        results, version = engine.generate(prompts, GREEDY)
        assert version == 2
        for g in results:
            ids = g.prompt_ids + g.output_ids
            expected = _teacher_forced(engine.model_config, v2, ids)
            start = len(g.prompt_ids) - 1
            for t, (token, logprob) in enumerate(zip(g.output_ids, g.logprobs)):
                assert abs(float(expected[start + t, token]) - logprob) < 1e-4
    finally:
        engine.close()


def test_keys_name_a_whole_prefix_under_one_version():
    """Block i's key depends on every token before it and on the weight version."""
    ids = list(range(48))
    keys = block_keys(ids, 16, version=1)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert block_keys(ids[:40], 16, version=1) == keys[:2]  # a shorter prompt: the same first blocks
    changed = [99] + ids[1:]
    assert all(a != b for a, b in zip(block_keys(changed, 16, version=1), keys))  # a change early moves all
    assert not set(block_keys(ids, 16, version=2)) & set(keys)
    cache = PrefixCache(BlockAllocator(8), 16, version=1)
    blocks = cache.allocator.allocate(3)
    cache.insert(keys, blocks)
    cache.allocator.free(blocks)  # the rows are done; the cache holds them
    assert cache.match(keys) == blocks and cache.evictable() == 3
    cache.clear(version=2)
    assert cache.match(cache.keys(ids)) == [] and cache.allocator.num_free == 7


def test_a_reply_is_cached_for_the_next_turn(long_model_dir):
    """A finished row's prompt and reply go to the cache: a second turn (history, reply, a new
    message) prefills only past the last full block of the reply, and gives the tokens and
    logprobs of no cache."""
    firsts = _conversations(8, 30, seed=3)
    reply = Sampling(temperature=0.0, max_new_tokens=60, ignore_eos=True)
    on, off = _engine(long_model_dir, True), _engine(long_model_dir, False)
    try:
        answers = on.generate(firsts, reply)[0]
        seconds = [f + a.output_ids + [5, 6, 7] for f, a in zip(firsts, answers)]
        prefix = on.core.scheduler.prefix
        before = prefix.hit_tokens
        got = on.generate(seconds, GREEDY)[0]
        hit = prefix.hit_tokens - before
        assert hit == sum((len(f) + 60 - 1) // 16 * 16 for f in firsts)  # every full block but the last token's
        plain = off.generate(seconds, GREEDY)[0]
        assert [g.output_ids for g in got] == [g.output_ids for g in plain]
        for g, p in zip(got, plain):
            assert max(abs(a - b) for a, b in zip(g.logprobs, p.logprobs)) < 1e-5
        assert _all_blocks_accounted(on)
    finally:
        on.close()
        off.close()


def test_preemption_and_the_cache_together_change_no_token(long_model_dir, monkeypatch):
    """A pool of two long rows' blocks, the cache on, 8 conversations over one start from two
    callers: rows grow, are preempted and come back through the cache (their prompt and outputs
    partly cached), finished rows' replies are cached and evicted again; every row gives the
    tokens and logprobs of an unpressured run with no cache."""
    import threading

    prompts = _conversations(8, 60, seed=5)
    sampling = Sampling(temperature=0.0, max_new_tokens=150, ignore_eos=True)
    engine = _engine(long_model_dir, True, max_batch_size=8)
    blocks = 2 * engine.core.shape.blocks_for(100 + 150) + 1
    monkeypatch.setattr(engine.core, "_cpu_blocks", lambda longest, rows: blocks)
    off = _engine(long_model_dir, False)
    try:
        out: dict[int, list] = {}
        callers = [threading.Thread(target=lambda c=c: out.__setitem__(c, engine.generate(prompts[c::2], sampling)[0]))
                   for c in range(2)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(120)
        scheduler = engine.core.scheduler
        assert scheduler.preempted > 0 and scheduler.prefix.hit_tokens > 0
        assert _all_blocks_accounted(engine)
        for c in range(2):
            plain = off.generate(prompts[c::2], sampling)[0]
            assert [g.output_ids for g in out[c]] == [g.output_ids for g in plain]
            for g, p in zip(out[c], plain):
                assert max(abs(a - b) for a, b in zip(g.logprobs, p.logprobs)) < 1e-5
    finally:
        engine.close()
        off.close()


def test_the_prefill_budget_counts_the_tokens_a_cache_hit_leaves_to_compute(long_model_dir):
    """16 prompts of 151-190 tokens, each its own, against a prefill budget of 800 tokens a
    forward: with nothing cached they take four forwards or more; asked again, their full
    blocks cached, the last few tokens each still computes fit one forward, and give the same
    tokens."""
    prompts = [_conversations(1, 150, seed=5 + i)[0] for i in range(16)]
    engine = _engine(long_model_dir, True)
    try:
        engine.core.prepare(engine.core.request(prompts, GREEDY))  # the scheduler, to set its budget on
        engine.core.scheduler.max_prefill_tokens = 800
        first, _ = engine.generate(prompts, GREEDY)
        scheduler = engine.core.scheduler
        assert scheduler.prefills_run >= 4
        before = scheduler.prefills_run
        again, _ = engine.generate(prompts, GREEDY)
        assert scheduler.prefills_run - before == 1
        assert [g.output_ids for g in again] == [g.output_ids for g in first]
    finally:
        engine.close()
