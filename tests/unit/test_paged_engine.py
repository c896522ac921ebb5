"""What the paged engine promises beyond the generation contract both generators keep
(tests/unit/test_torch_engine.py): draws that depend on each row alone, a prompt's prefill shared
by its samples, admission bounded by KV blocks, every block given back (also on a cancel), and
samples distributed as the softmax says."""

from __future__ import annotations

import json

import numpy
import pytest
import torch

from services.rollout.builtin import scheduler
from services.rollout.builtin.core import CoreSettings, GenerationCore
from services.rollout.builtin.scheduler import GenerationCancelled, PromptTooLong
from services.rollout.types import Sampling, pack_prompts
from tests.unit.test_torch_engine import TOKENIZER, _full_logits, _model, _prompts

torch.set_num_threads(1)

LONG = TOKENIZER.encode("the quick brown fox jumps over it")  # 33 tokens: 2 full blocks and a partial one


def _core(model, **settings) -> GenerationCore:
    return GenerationCore(model, TOKENIZER, torch.device("cpu"), CoreSettings(**settings))


def _free_blocks_all_back(core: GenerationCore) -> bool:
    allocator = core.cache.allocator
    return allocator.num_free == allocator.num_blocks - 1


def test_seeded_draws_do_not_depend_on_batching():
    model = _model()
    # A stop string that never comes keeps the host checking every `check_every` steps (rows
    # that can only end at the length limit are checked when they reach it, whatever the setting).
    sampling = Sampling(temperature=1.0, top_p=0.9, max_new_tokens=12, n=3, seed=11, ignore_eos=True, stop=("never said",))
    prompts = _prompts() + [LONG]
    runs = [_core(model, max_batch_size=b, check_every=c).generate(prompts, sampling) for b, c in ((256, 1), (2, 1), (5, 8))]
    assert [r.output_ids for r in runs[0]] == [r.output_ids for r in runs[1]] == [r.output_ids for r in runs[2]]
    assert len({tuple(r.output_ids) for r in runs[0]}) > len(prompts)  # samples differ from each other


def test_samples_sharing_a_prompts_blocks_match_a_full_forward():
    model = _model(dtype=torch.float32)
    core = _core(model, max_batch_size=4)
    results = core.generate([LONG, _prompts()[1]], Sampling(temperature=1.0, max_new_tokens=20, n=5, seed=2, ignore_eos=True))
    for result in results:
        logprobs = torch.log_softmax(_full_logits(model, result.prompt_ids + result.output_ids), dim=-1)
        start = len(result.prompt_ids)
        expected = [logprobs[start - 1 + k, tok].item() for k, tok in enumerate(result.output_ids)]
        assert result.logprobs == pytest.approx(expected, abs=1e-4)
        # plain Python values, ready for JSON or protobuf (no numpy or torch scalars)
        assert {type(t) for t in result.output_ids} == {int} and {type(x) for x in result.logprobs} == {float}
        json.dumps([result.output_ids, result.logprobs])
    greedy = core.generate([LONG], Sampling(temperature=0, max_new_tokens=20, n=3, ignore_eos=True))
    assert greedy[0].output_ids == greedy[1].output_ids == greedy[2].output_ids
    assert core.scheduler.last_stats.prefills == 1  # one prefill for the three samples
    assert _free_blocks_all_back(core)


def test_admission_waits_for_blocks_and_a_prompt_that_cannot_fit_is_refused(monkeypatch):
    model = _model()
    sampling = Sampling(temperature=0, max_new_tokens=20, ignore_eos=True)
    prompts = _prompts() * 2
    plenty = _core(model).generate(prompts, sampling)
    # 7 blocks: a row needs 2 (prompt + 20 new tokens < 32 positions), so 3 run at a time.
    monkeypatch.setattr(GenerationCore, "_cpu_blocks", lambda self, longest, rows: 7)
    core = _core(model)
    scarce = core.generate(prompts, sampling)
    assert [r.output_ids for r in scarce] == [r.output_ids for r in plenty]
    assert core.scheduler.last_stats.max_rows == 3
    assert _free_blocks_all_back(core)
    monkeypatch.setattr(GenerationCore, "_cpu_blocks", lambda self, longest, rows: 3)
    tiny = _core(model)
    with pytest.raises(PromptTooLong, match="prompts_ids: prompt 0 .* needs 4 KV blocks"):
        tiny.generate([LONG], Sampling(temperature=0, max_new_tokens=20, ignore_eos=True))
    assert _free_blocks_all_back(tiny)


def test_a_cancelled_call_stops_and_gives_every_block_back():
    model = _model()
    core = _core(model, max_batch_size=3)
    polls = []

    def cancelled() -> bool:
        polls.append(1)
        return len(polls) > 4

    with pytest.raises(GenerationCancelled):
        core.generate(_prompts() * 6, Sampling(max_new_tokens=40, ignore_eos=True, seed=0), cancelled)
    assert len(polls) == 5 and _free_blocks_all_back(core)
    assert len(core.generate(_prompts(), Sampling(max_new_tokens=3, seed=0))) == 4  # usable after


def test_with_nothing_to_stop_on_the_host_looks_only_when_a_row_reaches_its_limit():
    """Each host check is a device sync; rows that can only end at max_new_tokens need none
    before the first gets there: the host only takes their outputs so far LAST_ROUND_STEPS
    before that. The tokens are those of a call that looks after every step."""
    model = _model()
    prompts = _prompts()
    plain = Sampling(temperature=1.0, max_new_tokens=30, seed=4, ignore_eos=True)
    core = _core(model, max_batch_size=2, check_every=1)
    quiet = core.generate(prompts, plain)
    assert core.scheduler.last_stats.rounds == 2 * len(prompts) // 2  # per pair of rows: 21 steps, then 8
    checked = core.generate(prompts, Sampling(**{**plain.__dict__, "stop": ("never said",)}))
    assert core.scheduler.last_stats.rounds >= 29 * len(prompts) // 2
    assert [r.output_ids for r in quiet] == [r.output_ids for r in checked]
    assert [r.finish_reason for r in quiet] == ["length"] * len(prompts)


def test_rows_that_can_only_end_at_their_limit_are_never_read(monkeypatch):
    """Rows that can only end at max_new_tokens are looked at every MAX_UNCHECKED_STEPS steps, for
    a cancel, but never read (a read is a device sync that idles the device): the host knows when
    each reaches its limit. The tokens are those of a call that reads after every step; a cancel
    is still seen."""
    model = _model()  # (at most 64 positions: the limit is lowered to fit)
    prompts = _prompts()[:2]
    plain = Sampling(temperature=1.0, max_new_tokens=40, seed=4, ignore_eos=True)
    core = _core(model, max_batch_size=4, check_every=1)
    core.generate(prompts, plain)  # the runner this call needs exists
    reads = []
    monkeypatch.setattr(scheduler, "MAX_UNCHECKED_STEPS", 8)
    monkeypatch.setattr(core.runner, "read", lambda rows, read=core.runner.read: (reads.append(rows), read(rows))[1])
    quiet = core.generate(prompts, plain)
    monkeypatch.undo()
    assert core.scheduler.last_stats.rounds == 5 and reads == []  # 39 steps: 8, 8, 8, 8, then 7
    checked = core.generate(prompts, Sampling(**{**plain.__dict__, "stop": ("never said",)}))
    assert [r.output_ids for r in quiet] == [r.output_ids for r in checked]
    assert [len(r.output_ids) for r in quiet] == [40, 40]
    monkeypatch.setattr(scheduler, "MAX_UNCHECKED_STEPS", 8)
    polls = []
    with pytest.raises(GenerationCancelled):
        core.generate(prompts, plain, lambda: polls.append(1) or len(polls) > 1)
    assert len(polls) == 2 and _free_blocks_all_back(core)


def test_while_requests_arrive_and_the_batch_has_room_rounds_are_short():
    """Rows that can only end at their limit run on to the first finish between host looks; but
    with a request arriving while they run (and room in the batch), a round is `check_every`
    steps, so the next arrivals wait that long to join, not tens of steps. A lone call keeps its
    long rounds."""
    model = _model()
    plain = Sampling(temperature=1.0, max_new_tokens=40, seed=4, ignore_eos=True)
    core = _core(model, max_batch_size=8, check_every=4)
    first = core.submit(core.request(_prompts()[:2], plain))
    core.round()
    s = core.scheduler
    assert s.steps_run > 4  # a lone call: on towards its rows' limit
    second = core.submit(core.request(_prompts()[2:3], plain))
    steps = s.steps_run
    core.round()  # admits the arrival, and runs check_every steps
    assert s.rows_running == 3 and s.steps_run - steps == 4
    while not (first.finished.is_set() and second.finished.is_set()):
        core.round()
    assert [len(g.output_ids) for g in first.wait() + second.wait()] == [40, 40, 40]


def test_outputs_taken_in_pieces_while_decoding_come_back_whole(monkeypatch):
    """Rows that can only end at their length limit have their outputs so far copied out and
    turned into lists while later steps run, a piece every MAX_UNCHECKED_STEPS steps. With rows
    admitted at different times (so their pieces start at different tokens) and packed when others
    finish, every result holds the same tokens and logprobs (to float32 rounding: the batches
    differ), as plain Python numbers, as a call that reads after every step and takes each row's
    outputs at its end."""
    model = _model(dtype=torch.float32)
    prompts = _prompts() + [LONG]
    sampling = Sampling(temperature=1.0, max_new_tokens=23, n=2, seed=9, ignore_eos=True)
    core = _core(model, max_batch_size=5, check_every=1)
    core.generate(prompts, sampling)  # the pool this call needs exists
    monkeypatch.setattr(scheduler, "MAX_UNCHECKED_STEPS", 5)
    monkeypatch.setattr(core.scheduler, "max_prefill_tokens", 1)  # a prompt a round: rows of different ages
    pieces = []
    monkeypatch.setattr(core.scheduler, "_outputs_so_far",
                        lambda rows, made, take=core.scheduler._outputs_so_far: (pieces.append(list(made)),
                                                                                 take(rows, made))[1])
    taken = core.generate(prompts, sampling)
    monkeypatch.undo()
    assert len(pieces) >= 4 and len({m for made in pieces for m in made}) > 2  # rows at different points
    whole = core.generate(prompts, Sampling(**{**sampling.__dict__, "stop": ("never said",)}))
    assert [r.output_ids for r in taken] == [r.output_ids for r in whole]
    for a, b in zip(taken, whole):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [len(r.output_ids) for r in taken] == [len(r.logprobs) for r in taken] == [23] * len(taken)
    assert {type(t) for r in taken for t in r.output_ids} == {int}
    assert {type(x) for r in taken for x in r.logprobs} == {float}
    assert _free_blocks_all_back(core)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8)])
def test_first_tokens_follow_the_filtered_softmax(temperature, top_k, top_p):
    """1000 draws of one token: each token's frequency within 5 standard errors of its probability."""
    model = _model(dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(0.15)  # a spread-out distribution: many tokens matter
    prompt = _prompts()[0]
    draws = 1000
    results = _core(model, max_batch_size=1000).generate(
        [prompt], Sampling(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, n=draws, seed=5))
    counts = torch.bincount(torch.tensor([r.output_ids[0] for r in results]), minlength=TOKENIZER.vocab_size).double()
    scores = _full_logits(model, prompt)[-1] / temperature
    if top_k:
        scores[scores < scores.topk(top_k).values[-1]] = float("-inf")
    if top_p < 1:
        ordered, order = scores.sort(descending=True)
        probs = ordered.softmax(-1)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, probs.cumsum(-1) - probs >= top_p)
        scores[drop] = float("-inf")
    expected = scores.softmax(-1)
    assert (expected > 0.02).sum() >= 3  # the test can tell distributions apart
    stderr = (expected * (1 - expected) / draws).sqrt()
    assert ((counts / draws - expected).abs() <= 5 * stderr + 1e-9).all(), (counts / draws, expected)
    assert counts[expected == 0].sum() == 0


def test_a_prefill_padded_to_its_gpu_shape_gives_the_same_logits_and_cache(monkeypatch):
    """On a GPU prefills are padded to a few shapes (so that few graphs serve them): padding
    prompts and padding positions must change neither the real prompts' logits nor any cache
    block but the trash block. Run here by padding on the CPU as a GPU would."""
    from services.rollout.builtin import runner as runner_module
    from services.rollout.builtin.kv_cache import TRASH_BLOCK

    model = _model(dtype=torch.float32)
    prompts = [LONG, _prompts()[1], _prompts()[0]]
    core = _core(model, max_batch_size=8)
    core.generate(prompts, Sampling(temperature=0, max_new_tokens=1))  # makes the pool and runner
    runner, cache = core.runner, core.cache
    bs = cache.shape.block_size
    tables = [cache.allocator.allocate(cache.shape.blocks_for(len(p))) for p in prompts]

    def prefill(shape) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(runner_module.ModelRunner, "prefill_shape", lambda self, g, n: shape or (g, n))
        cache.kv.zero_()
        with torch.inference_mode():
            logits = runner._prefill_logits(pack_prompts(prompts), list(range(len(prompts))), tables)
        return logits, cache.kv.clone()

    plain_logits, plain_cache = prefill(None)
    padded_logits, padded_cache = prefill((4, 48))
    assert padded_logits.shape[0] == 4 and plain_logits.shape[0] == len(prompts)
    torch.testing.assert_close(padded_logits[: len(prompts)], plain_logits, rtol=1e-5, atol=1e-5)
    real = [b for b in range(cache.num_blocks) if b != TRASH_BLOCK]
    torch.testing.assert_close(padded_cache[:, :, real], plain_cache[:, :, real], rtol=1e-5, atol=1e-5)
    written = sum(len(p) for p in prompts)
    assert int((plain_cache[0, 0, real].abs().sum(dim=(-1, -2)) != 0).sum()) == written  # one row per token
    assert bs * len(real) >= written


def test_prompts_are_checked_and_packed_once_whatever_sequences_hold_them():
    from services.rollout.types import validate_prompts

    sampling = Sampling(max_new_tokens=4)
    packed = validate_prompts([[5, 6, 7], (8,), range(9, 11)], sampling, 100, 64)
    assert packed.flat.tolist() == [5, 6, 7, 8, 9, 10] and packed.lengths.tolist() == [3, 1, 2]
    # any subset, in any order, right-padded: what a prefill of those prompts reads
    assert packed.rows([2, 0], 4, fill=-1).tolist() == [[9, 10, -1, -1], [5, 6, 7, -1]]
    assert packed.rows([], 2).shape == (0, 2)
    assert _core(_model()).generate([], sampling) == []  # no prompts: no completions, no error
    with pytest.raises(ValueError, match="a prompt of 3 ids does not fit in 2"):
        packed.rows([0], 2)
    model = _model()
    greedy = Sampling(temperature=0, max_new_tokens=6, ignore_eos=True)
    prompts = _prompts() + [LONG]
    lists = _core(model, max_batch_size=2).generate(prompts, greedy)  # admitted in rounds
    # as RL code holds them: tuples, numpy arrays, torch tensors (LONG, last, as a tuple)
    kinds = [tuple, numpy.array, torch.tensor, list]
    mixed = [kinds[i % 4](p) if i < 4 else tuple(p) for i, p in enumerate(prompts)]
    others = _core(model, max_batch_size=2).generate(mixed, greedy)
    assert [r.output_ids for r in others] == [r.output_ids for r in lists]
    assert [r.prompt_ids for r in others] == prompts and others[-1].prompt_ids == LONG
    # plain Python ints in the results (JSON, protobuf), whatever held the prompt
    assert {type(t) for r in others for t in r.prompt_ids} == {int}
    json.dumps([r.prompt_ids for r in others])
    for bad, message in ((numpy.array(3), "prompt 0 is not a sequence of token ids"),
                         (numpy.array([3.0, 4.0]), "prompt 0 holds token ids that are not integers"),
                         (torch.tensor([3, 10**6]), "prompt 0 has token ids outside"),
                         (numpy.array([], dtype=numpy.int64), "prompt 0 is empty")):
        with pytest.raises(ValueError, match=message):
            validate_prompts([bad], sampling, 100, 64)


def test_an_admission_takes_the_blocks_one_allocation_a_prompt_would_take(monkeypatch):
    """The scheduler plans an admission, then takes all its blocks in one allocation: each row
    must get the blocks it got when each prompt allocated its own (the prompt's full blocks
    shared by its samples, then each sample's own), and every block must come back."""
    from services.rollout.builtin.kv_cache import BlockAllocator

    core = _core(_model(), max_batch_size=16)
    prompts = [LONG, _prompts()[1], _prompts()[0]]  # 2 full blocks and a partial one; partial ones
    sampling = Sampling(temperature=1.0, max_new_tokens=10, n=3, seed=3, ignore_eos=True)
    core.generate(prompts, sampling)  # makes the pool; its frees leave the free list in some order
    reference = BlockAllocator(core.cache.num_blocks)
    reference._free = list(core.cache.allocator._free)  # the same state
    tables = []
    plain_start = core.runner.start
    monkeypatch.setattr(core.runner, "start", lambda logits, rows, first, mode: (
        tables.extend(row.block_table for row in rows), plain_start(logits, rows, first, mode)))
    core.generate(prompts, sampling)
    bs, expected = core.cache.shape.block_size, []
    for prompt in prompts:  # one allocation a prompt, as before
        shared, per_row = len(prompt) // bs, -(-(len(prompt) + sampling.max_new_tokens) // bs)
        own = per_row - shared
        blocks = reference.allocate(shared + sampling.n * own)
        expected += [blocks[:shared] + blocks[shared + i * own : shared + (i + 1) * own] for i in range(sampling.n)]
    assert tables == expected
    assert _free_blocks_all_back(core)


def test_padded_host_tensors_hold_the_rows_and_their_fill():
    from services.rollout.builtin.runner import padded

    rows = [[5, 6, 7], [], [2**40]]
    assert torch.equal(padded(rows, 4, -1, torch.int64), torch.tensor([[5, 6, 7, -1], [-1] * 4, [2**40, -1, -1, -1]]))
    assert padded([[1, 2]], 2, 0, torch.int32).dtype == torch.int32
    assert padded([], 3, 0, torch.int32).shape == (0, 3)
    with pytest.raises(ValueError, match="a row of 3 values does not fit in 2"):
        padded([[1, 2, 3]], 2, 0, torch.int32)
    with pytest.raises(OverflowError):  # an int32 table never wraps a block id silently
        padded([[2**31]], 1, 0, torch.int32)


def test_finished_rows_are_handed_back_while_the_next_decode_runs_and_come_back_the_same(monkeypatch):
    """A round's finished rows have their outputs copied out and their blocks freed at the check;
    turning them into results (lists, text) waits until the next round's decode steps are queued,
    so the device is not idle meanwhile. Stop strings and stop tokens still cut where they did:
    the results equal those of a call that looks after every step with room for every row."""
    model = _model()
    sampling = Sampling(temperature=1.0, max_new_tokens=16, n=2, seed=5, stop=("e",))
    prompts = _prompts() * 2
    core = _core(model, max_batch_size=3, check_every=2)
    core.generate(prompts, sampling)  # the pool and runner this call needs exist
    runner, events = core.runner, []

    def logged(name, method):
        return lambda *args, **kwargs: (events.append(name), method(*args, **kwargs))[1]

    monkeypatch.setattr(runner, "decode", logged("decode", runner.decode))
    monkeypatch.setattr(runner, "read", logged("read", runner.read))
    monkeypatch.setattr(runner, "outputs_async", logged("copy out", runner.outputs_async))
    monkeypatch.setattr(TOKENIZER, "decode_batch", logged("hand back", TOKENIZER.decode_batch))
    streamed = core.generate(prompts, sampling)
    monkeypatch.undo()
    copies = [i for i, e in enumerate(events) if e == "copy out"]
    handed = [i for i, e in enumerate(events) if e == "hand back"]
    assert len(handed) > 2
    for i in handed[:-1]:  # every hand-back but the call's last: after the next decode is queued, before its read
        assert events[i - 1] == "decode" and events[i + 1] == "read"
    assert all(events[i - 1] == "read" for i in copies)  # copied out at the check itself
    whole = _core(model, max_batch_size=256, check_every=1).generate(prompts, sampling)
    assert [(r.output_ids, r.text, r.finish_reason) for r in streamed] == [(r.output_ids, r.text, r.finish_reason)
                                                                          for r in whole]
    assert _free_blocks_all_back(core)


def test_garbage_collections_run_while_steps_are_queued_never_in_an_admission_and_as_found_after(monkeypatch):
    """Python's collector is off during a call (a collection in an admission or after the last
    step leaves the device waiting), and runs what it owes where decode steps were just queued.
    A caller's collector is on again after the call, off if the caller had turned it off, and
    after an error too."""
    import gc

    core = _core(_model(), max_batch_size=3, check_every=1)
    core.generate(_prompts() * 4, Sampling(max_new_tokens=6, seed=0))  # the pool and scheduler this call keeps
    state = {"admitting": False, "collections": 0, "in_admission": 0}
    real_admit, real_keep = core.scheduler._admit, core.runner.keep
    kept = []  # objects the collector tracks, alive to the call's end: it owes collections over them

    def admit(*args, **kwargs):
        state["admitting"] = True
        kept.extend([i] for i in range(1000))
        try:
            return real_admit(*args, **kwargs)
        finally:
            state["admitting"] = False

    def keep(*args, **kwargs):
        kept.extend([i] for i in range(1000))
        return real_keep(*args, **kwargs)

    def callback(phase, info):
        if phase == "start":
            state["collections"] += 1
            state["in_admission"] += state["admitting"]

    monkeypatch.setattr(core.scheduler, "_admit", admit)
    monkeypatch.setattr(core.runner, "keep", keep)
    gc.callbacks.append(callback)
    try:
        assert gc.isenabled()
        results = core.generate(_prompts() * 4, Sampling(max_new_tokens=6, seed=1, stop_token_ids=(3,)))
        assert gc.isenabled() and len(results) == 16
        assert state["collections"] > 0 and state["in_admission"] == 0  # owed ones ran, none in an admission
        kept.clear()
        gc.disable()
        core.generate(_prompts(), Sampling(max_new_tokens=6, seed=1))
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(GenerationCancelled):
            core.generate(_prompts() * 4, Sampling(max_new_tokens=6, seed=1), lambda: True)
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(callback)
        gc.enable()
