"""The built-in engine as a server: every caller's rows in one running batch, joining and leaving
it between rounds, each call answered (or streamed) as its own rows finish, one caller's cancel
touching no one else, eval and train requests both admitted, and weight updates between rounds
under the three policies, with every token tagged by the version that sampled it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.models.decoder import DecoderLM, init_weights
from services.rollout.builtin.scheduler import GenerationCancelled, versions_of
from services.rollout.engine import RolloutEngine, RolloutSettings
from services.rollout.receiver import Staging
from services.rollout.types import Sampling
from services.weights.apply import named_weights
from services.weights.buckets import pack_bucket, plan_buckets
from services.weights.manifest import make_manifest, manifest_to_proto

torch.set_num_threads(1)

SEEDED = Sampling(temperature=1.0, max_new_tokens=24, seed=5, ignore_eos=True)
GREEDY = Sampling(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def _engine(model_dir, device: str = "cpu", **settings) -> RolloutEngine:
    return RolloutEngine(RolloutSettings(model_path=str(model_dir), load_weights=False, seed=3, device=device,
                                         **settings))


def _prompt(i: int) -> list[int]:
    return [3 + i % 11, 4 + (i * 7) % 9, 5]


def _solo(model_dir, prompts, sampling, device: str = "cpu", **settings):
    engine = _engine(model_dir, device, **settings)
    try:
        return engine.generate(prompts, sampling)[0]
    finally:
        engine.close()


def _concurrently(calls):
    """Run each call on its own thread at once; their results (or exceptions), in order."""
    out: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i, call):
        barrier.wait()
        try:
            out[i] = call()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out[i] = e

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _all_blocks_back(engine: RolloutEngine) -> bool:
    allocator = engine.core.cache.allocator
    return allocator.num_free == allocator.num_blocks - 1


def test_concurrent_callers_share_one_batch_and_get_their_own_tokens(tiny_model_dir):
    check_concurrent_callers(tiny_model_dir, "cpu")


def check_concurrent_callers(tiny_model_dir, device: str) -> None:
    """32 one-prompt callers at once: they run together (the batch holds many of them at a time),
    and each gets exactly what it gets alone (its draws depend on its own seed and row only)."""
    engine = _engine(tiny_model_dir, device, max_batch_size=64)
    prompts = [_prompt(i) for i in range(32)]
    samplings = [Sampling(**{**SEEDED.__dict__, "seed": 100 + i}) for i in range(32)]
    results = _concurrently([lambda p=p, s=s: engine.generate([p], s)[0] for p, s in zip(prompts, samplings)])
    scheduler = engine.core.scheduler
    alone = [_solo(tiny_model_dir, [p], s, device, max_batch_size=64) for p, s in zip(prompts[:6], samplings[:6])]
    engine.close()
    assert all(isinstance(r, list) for r in results), results
    assert scheduler.peak_rows > 8  # callers' rows ran side by side, not a call at a time
    assert scheduler.rounds_run < 32 * SEEDED.max_new_tokens / 4  # far fewer rounds than one call after another
    assert [r[0].output_ids for r in results[:6]] == [a[0].output_ids for a in alone]
    assert len({tuple(r[0].output_ids) for r in results}) > 16  # their own seeds: different samples
    assert all(r[0].versions == ((0, SEEDED.max_new_tokens),) for r in results)


def test_callers_arriving_while_rows_run_join_them_and_keep_their_own_tokens(tiny_model_dir):
    """Clients that send a request as soon as their last one ends, having started a round apart:
    the pool (made for the first caller's one row) grows for them and they run side by side. They
    finish at different steps; with checks every 8 steps (a GPU's default) rows that reach their
    limit inside a round sit done until it ends, and come back with exactly their own tokens."""
    engine = _engine(tiny_model_dir, max_batch_size=32)
    engine.core.check_every = 8
    sampling = Sampling(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    clients, turns = 8, 4
    outputs: dict[int, list] = {i: [] for i in range(clients)}

    def client(i):
        for t in range(turns):
            outputs[i].append(engine.generate([_prompt(i * turns + t)], sampling)[0][0])

    def rounds_run() -> int:
        return engine.core.scheduler.rounds_run if engine.core.scheduler is not None else 0

    threads = []
    for i in range(clients):
        threads.append(threading.Thread(target=client, args=(i,)))
        threads[-1].start()
        start, deadline = rounds_run(), time.monotonic() + 30
        while rounds_run() < start + 1 and time.monotonic() < deadline:
            time.sleep(0.0005)
    for t in threads:
        t.join(120)
    peak = engine.core.scheduler.peak_rows
    engine.close()
    alone = _solo(tiny_model_dir, [_prompt(k) for k in range(clients * turns)], sampling)
    got = [g for i in range(clients) for g in outputs[i]]
    assert [g.output_ids for g in got] == [a.output_ids for a in alone]
    assert all(g.versions == ((0, 12),) and g.finish_reason == "length" for g in got)
    assert peak > 2


def test_each_completion_is_reported_as_it_finishes(tiny_model_dir):
    """A request's completions come back one by one: the first is reported while others of the
    same request are still generating, and every index comes exactly once."""
    engine = _engine(tiny_model_dir, max_batch_size=16)
    sampling = Sampling(temperature=1.0, max_new_tokens=40, seed=2, n=8, stop_token_ids=(7, 9, 11))
    seen, still_running = [], []
    holder = {}

    def on_result(index, generation):
        request = holder["request"]
        still_running.append(sum(row.request is request for row in engine.core.scheduler._rows))
        seen.append((index, generation))

    holder["request"] = engine.submit([_prompt(1), _prompt(2)], sampling, on_result=on_result)
    results = holder["request"].wait(60)
    engine.close()
    assert sorted(i for i, _ in seen) == list(range(16))
    assert [results[i] for i, _ in seen] == [g for _, g in seen]
    assert still_running[0] > 0  # reported while rows of its request still ran
    assert len({len(g.output_ids) for _, g in seen}) > 1


def test_one_caller_cancelling_leaves_the_others_untouched(tiny_model_dir):
    engine = _engine(tiny_model_dir, max_batch_size=32)
    flag = threading.Event()
    polls = []

    def cancelled():
        polls.append(1)
        if len(polls) == 4:
            flag.set()
        return flag.is_set()

    prompts = [_prompt(i) for i in range(8)]
    calls = [lambda p=p: engine.generate([p], GREEDY)[0] for p in prompts]
    # (a stop string that never comes: the batch is looked at every step, a poll a round)
    calls.append(lambda: engine.generate([_prompt(20)] * 4, Sampling(**{**GREEDY.__dict__, "stop": ("never said",)}),
                                         cancelled=cancelled))
    results = _concurrently(calls)
    assert isinstance(results[-1], GenerationCancelled)
    alone = _solo(tiny_model_dir, prompts, GREEDY, max_batch_size=32)
    assert [r[0].output_ids for r in results[:-1]] == [a.output_ids for a in alone]
    assert _all_blocks_back(engine)
    engine.close()


def test_a_pool_too_small_for_every_row_finishes_them_all_with_the_same_tokens(tiny_model_dir, monkeypatch):
    """64 rows from 16 callers into a KV pool that holds three rows at a time: every row waits
    for blocks rather than being refused, and the greedy tokens are those of an unpressured run."""
    engine = _engine(tiny_model_dir, max_batch_size=64)
    rows_blocks = engine.core.shape.blocks_for(3 + GREEDY.max_new_tokens)
    monkeypatch.setattr(engine.core, "_cpu_blocks", lambda longest, rows: 3 * rows_blocks + 1)
    prompts = [[_prompt(4 * c + k) for k in range(4)] for c in range(16)]
    results = _concurrently([lambda p=p: engine.generate(p, GREEDY)[0] for p in prompts])
    assert engine.core.scheduler.peak_rows == 3
    assert _all_blocks_back(engine)
    engine.close()
    free = _solo(tiny_model_dir, [p for group in prompts for p in group], GREEDY, max_batch_size=64)
    assert [g.output_ids for r in results for g in r] == [g.output_ids for g in free]


def test_an_eval_request_is_admitted_while_train_rows_fill_the_batch(tiny_model_dir):
    """256 train rows waiting behind a full batch of 16: an eval request of the same settings
    (admitted in turn with train, a prompt each) finishes long before the train rows queued ahead
    of it; one of other settings (greedy) waits only for the rows running, not for the queue,
    and the train requests after it do not overtake it."""
    engine = _engine(tiny_model_dir, max_batch_size=16)
    done_at: dict[str, float] = {}
    train = [engine.submit([_prompt(i)], SEEDED, on_result=lambda i, g, k=k: done_at.setdefault(f"t{k}", time.monotonic()))
             for k, i in enumerate(range(256))]
    time.sleep(0.05)  # the batch is running
    before = len(done_at)  # train rows already done when the eval requests arrive
    same = engine.submit([_prompt(3)], Sampling(**{**SEEDED.__dict__, "seed": 9}), priority="eval")
    other = engine.submit([_prompt(4)], GREEDY, priority="eval")
    after = engine.submit([_prompt(5)], SEEDED)
    same.wait(120)
    finished_same = time.monotonic()
    other.wait(120)
    finished_other = time.monotonic()
    after.wait(120)
    for r in train:
        r.wait(120)
    engine.close()
    train_done = sorted(done_at.values())
    assert before < 192, "the machine ran the whole train queue before the eval request came"
    assert sum(t < finished_same for t in train_done) - before < 64  # most train rows queued ahead of it were not
    assert sum(t < finished_other for t in train_done) < 256  # it did not wait for the whole queue ...
    assert max(train_done) > finished_other  # ... train rows ran after it ...
    assert same.results[0].output_ids and other.results[0].output_ids and after.results[0].output_ids


# ---- weight updates while generating --------------------------------------------------------

BUCKET_BYTES = 64 << 10


def _versions(engine: RolloutEngine, count: int) -> list[dict[str, torch.Tensor]]:
    """Weights for versions 1..count that differ only in the final norm: the keys and values a
    prefix leaves in the cache are the same under all of them, so a teacher-forced forward under
    one version's weights recomputes exactly the logprobs that version sampled with."""
    base = DecoderLM(engine.model_config)
    init_weights(base, seed=11)
    weights = {name: t.detach().clone() for name, t in named_weights(base)}
    out = []
    for v in range(count):
        gen = torch.Generator().manual_seed(v)
        changed = dict(weights)
        changed["model.norm.weight"] = weights["model.norm.weight"] * (0.5 + 2 * torch.rand(
            weights["model.norm.weight"].shape, generator=gen))
        out.append(changed)
    return out


def _packed(weights, version: int) -> tuple:
    """An update's manifest and buckets, packed ahead (`_update` then only stages and applies)."""
    buckets = plan_buckets(list(weights.items()), BUCKET_BYTES)
    flats = [pack_bucket(b, weights) for b in buckets]
    return manifest_to_proto(make_manifest(version, "gpu", buckets, flats, "xxh3")), flats


def _update(engine: RolloutEngine, staging: Staging, weights, version: int, policy: str, packed=None) -> None:
    message, flats = packed or _packed(weights, version)
    manifest = engine.read_manifest(message)
    buffers = staging.buffers(manifest)
    for buffer, flat in zip(buffers, flats):
        buffer.copy_(flat)
    engine.apply(manifest, buffers, adopt=True, owned=True, policy=policy)
    staging.adopted(buffers, kept=engine.holds_buffers)


def _teacher_forced(config, weights, ids: list[int], device: str = "cpu") -> torch.Tensor:
    model = DecoderLM(config).to(device)
    with torch.no_grad():
        for name, t in named_weights(model):
            t.copy_(weights[name])
        return torch.log_softmax(model(torch.tensor([ids], device=device))[0].double(), dim=-1).cpu()


def _rounds(engine: RolloutEngine) -> int:
    return engine.core.scheduler.rounds_run


def _after_rounds(engine: RolloutEngine, count: int) -> None:
    start = _rounds(engine)
    deadline = time.monotonic() + 30
    while _rounds(engine) < start + count and time.monotonic() < deadline:
        time.sleep(0.001)


def test_pause_swaps_between_steps_and_every_token_names_the_weights_that_sampled_it(tiny_model_dir):
    check_pause_versions(tiny_model_dir, "cpu", tolerance=1e-4)


def check_pause_versions(tiny_model_dir, device: str, tolerance: float, min_spanning: int = 5,
                         rounds_between: int = 6, new_tokens: int = 40) -> None:
    """Streaming callers run across five updates with `pause`: completions span versions, and
    each token's logprob is the one its claimed version's weights give (teacher-forced), not the
    one the version before or after gives."""
    engine = _engine(tiny_model_dir, device, max_batch_size=8)
    versions = _versions(engine, 6)
    staging = Staging(engine.device)
    _update(engine, staging, versions[0], 1, "drain")
    # (a stop string that never comes: a round a step, so updates land between any two tokens)
    sampling = Sampling(temperature=1.0, max_new_tokens=new_tokens, seed=1, ignore_eos=True, stop=("never said",))
    packed = {v: _packed(versions[v - 1], v) for v in range(2, 7)}  # (so that updates land rounds apart)
    requests = [engine.submit([_prompt(i)], Sampling(**{**sampling.__dict__, "seed": i}), on_result=lambda i, g: None)
                for i in range(24)]
    for v in range(2, 7):  # (a round is a step on a CPU, 8 on a GPU)
        _after_rounds(engine, rounds_between)
        _update(engine, staging, versions[v - 1], v, "pause", packed[v])
    results = [g for r in requests for g in r.wait(120)]
    engine.close()
    spanning = [g for g in results if len(g.versions) > 1]
    assert len(spanning) >= min_spanning and {v for g in results for v, _ in g.versions} >= {1, 2, 3, 4, 5, 6}
    checked = discriminating = 0
    for g in results:
        assert sum(n for _, n in g.versions) == len(g.output_ids) == new_tokens
        claimed = [v for v, n in g.versions for _ in range(n)]
        ids = g.prompt_ids + g.output_ids
        tables = {v: _teacher_forced(engine.model_config, versions[v - 1], ids, device) for v in set(claimed) | {
            c + 1 for c in claimed if c < 6} | {c - 1 for c in claimed if c > 1}}
        start = len(g.prompt_ids) - 1
        for k, (token, logprob, v) in enumerate(zip(g.output_ids, g.logprobs, claimed)):
            assert logprob == pytest.approx(tables[v][start + k, token].item(), abs=tolerance), (g.versions, k)
            checked += 1
            others = [tables[w][start + k, token].item() for w in (v - 1, v + 1) if w in tables]
            # (a wrong version is caught where its logprob is off by more than the tolerance)
            discriminating += all(abs(o - logprob) > 3 * tolerance for o in others)
    assert checked == 24 * new_tokens and discriminating > 0.9 * checked  # another version would be caught


def test_abort_ends_running_rows_with_their_tokens_and_waiting_rows_run_on_the_new_weights(tiny_model_dir):
    check_abort(tiny_model_dir, "cpu")


def check_abort(tiny_model_dir, device: str, rounds: int = 5, prompts: int = 12) -> None:
    engine = _engine(tiny_model_dir, device, max_batch_size=4)
    versions = _versions(engine, 2)
    staging = Staging(engine.device)
    _update(engine, staging, versions[0], 1, "drain")
    sampling = Sampling(temperature=1.0, max_new_tokens=40, seed=1, ignore_eos=True, stop=("never said",))
    packed = _packed(versions[1], 2)  # (so that the update lands within a round of being asked for)
    request = engine.submit([_prompt(i) for i in range(prompts)], sampling)  # on a CPU a round a step: 4 rows at step 5
    _after_rounds(engine, rounds)
    _update(engine, staging, versions[1], 2, "abort", packed)
    results = request.wait(60)
    engine.close()
    aborted = [g for g in results if g.finish_reason == "abort"]
    assert len(aborted) == 4  # the batch's four running rows
    assert all(0 < len(g.output_ids) < 40 and len(g.logprobs) == len(g.output_ids) for g in aborted)
    assert all(g.versions == ((1, len(g.output_ids)),) for g in aborted)
    rest = [g for g in results if g.finish_reason != "abort"]
    assert len(rest) == prompts - 4 and all(g.versions == ((2, 40),) for g in rest)


def test_a_submission_never_waits_for_the_engine_lock(tiny_model_dir):
    """With the engine's lock held (a long round, or an update copying weights), `submit` still
    returns at once: the request waits in the inbox and runs once the lock is free."""
    engine = _engine(tiny_model_dir, max_batch_size=4)
    sampling = Sampling(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    try:
        engine.generate([_prompt(0)], sampling)  # (the pool and the serving thread exist)
        with engine._lock:
            started = time.monotonic()
            request = engine.submit([_prompt(1), _prompt(2)], sampling)
            assert time.monotonic() - started < 0.5
            time.sleep(0.2)
            assert not request.finished.is_set()
        results = request.wait(30)
        assert [len(g.output_ids) for g in results] == [5, 5]
    finally:
        engine.close()


def test_drain_waits_for_started_requests_and_holds_new_ones(tiny_model_dir):
    """Today's behaviour: the update waits for the call in flight (all its tokens from the old
    version); a call that arrives during the drain starts after it, all from the new one."""
    engine = _engine(tiny_model_dir, max_batch_size=4)
    versions = _versions(engine, 2)
    staging = Staging(engine.device)
    _update(engine, staging, versions[0], 1, "drain")
    sampling = Sampling(temperature=1.0, max_new_tokens=40, seed=1, ignore_eos=True)
    first = engine.submit([_prompt(i) for i in range(12)], sampling)  # more rows than slots
    _after_rounds(engine, 3)
    updating = threading.Thread(target=_update, args=(engine, staging, versions[1], 2, "drain"))
    updating.start()
    time.sleep(0.05)
    later = engine.submit([_prompt(1)], sampling)
    updating.join(60)
    assert engine.weight_version == 2
    assert all(g.versions == ((1, 40),) for g in first.wait(60))
    assert later.wait(60)[0].versions == ((2, 40),)
    engine.close()


def test_a_failed_update_ends_the_rows_that_were_running_and_serves_nothing_mixed(tiny_model_dir):
    from services.rollout.engine import EngineUnavailable

    engine = _engine(tiny_model_dir, max_batch_size=4)
    versions = _versions(engine, 2)
    staging = Staging(engine.device)
    _update(engine, staging, versions[0], 1, "drain")
    request = engine.submit([_prompt(i) for i in range(4)], Sampling(max_new_tokens=40, seed=1, ignore_eos=True,
                                                                     stop=("never said",)))
    _after_rounds(engine, 3)
    buckets = plan_buckets(list(versions[1].items()), BUCKET_BYTES)
    flats = [pack_bucket(b, versions[1]) for b in buckets]
    manifest = engine.read_manifest(manifest_to_proto(make_manifest(2, "gpu", buckets, flats, "xxh3")))
    buffers = staging.buffers(manifest)
    for buffer, flat in zip(buffers, flats):
        buffer.copy_(flat)
    buffers[0][:16] ^= 0xFF  # bytes that do not read back as the manifest says
    with pytest.raises(Exception, match="did not verify"):
        engine.apply(manifest, buffers, adopt=True, owned=True, policy="pause", read_back=True)
    with pytest.raises(EngineUnavailable, match="failed while this request ran"):
        request.wait(30)
    with pytest.raises(EngineUnavailable):
        engine.submit([_prompt(0)], GREEDY)
    engine.close()


def test_version_runs_cover_the_tokens():
    assert versions_of([(1, 0)], 5) == ((1, 5),)
    assert versions_of([(1, 0), (2, 3), (3, 3), (4, 7)], 9) == ((1, 3), (3, 4), (4, 2))
    assert versions_of([(1, 0), (2, 9)], 4) == ((1, 4),)  # (an abort's row kept fewer)


# ---- preemption: rows admitted short of what they may make, recomputed when the pool runs out --


def _pressured(engine: RolloutEngine, monkeypatch, rows_that_fit: int, longest: int) -> None:
    """A CPU pool that holds `rows_that_fit` rows of `longest` tokens (it never grows)."""
    blocks = rows_that_fit * engine.core.shape.blocks_for(longest) + 1
    monkeypatch.setattr(engine.core, "_cpu_blocks", lambda longest_, rows: blocks)


@pytest.mark.parametrize("sampling", [
    Sampling(temperature=0.0, max_new_tokens=150, ignore_eos=True),
    Sampling(temperature=1.0, max_new_tokens=150, seed=2, n=2, ignore_eos=True),
], ids=["greedy", "seeded-n2"])
def test_a_full_pool_preempts_the_youngest_rows_and_they_finish_as_if_never_preempted(long_model_dir, monkeypatch,
                                                                                    sampling):
    """12 rows of up to 170 tokens from 4 callers into a pool of three such rows: rows are
    admitted with blocks for part of their completion, grow, and when the pool runs dry the
    youngest are preempted and later recomputed from their prompt and outputs. Every row
    finishes with the tokens and draws of an unpressured run (logprobs within 1e-5), the
    preempted ones included, and every block comes back."""
    prompts = [[3 + (i * 5 + k) % 13 for k in range(8 + 2 * i)] for i in range(12 // sampling.n)]
    engine = _engine(long_model_dir, max_batch_size=8)
    _pressured(engine, monkeypatch, 3, 24 + 150)
    calls = [lambda p=prompts[c::4]: engine.generate(p, sampling)[0] for c in range(4)]
    results = _concurrently(calls)
    scheduler = engine.core.scheduler
    assert _all_blocks_back(engine)
    engine.close()
    assert scheduler.preempted > 0 and scheduler.peak_rows > 3  # more rows ran than full reservations fit
    # (each call's own: a draw's key is the call's seed, the prompt's index in it and the sample's)
    free = [g for c in range(4) for g in _solo(long_model_dir, prompts[c::4], sampling, max_batch_size=16)]
    got = [g for r in results for g in r]
    assert [g.output_ids for g in got] == [g.output_ids for g in free]
    for g, f in zip(got, free):
        assert len(g.logprobs) == 150 and max(abs(a - b) for a, b in zip(g.logprobs, f.logprobs)) < 1e-5


def test_an_abort_ends_preempted_rows_too(long_model_dir, monkeypatch):
    """Rows waiting to be recomputed are in flight: an `abort` update ends them with their
    tokens so far, as it ends the rows running."""
    engine = _engine(long_model_dir, max_batch_size=8)
    _pressured(engine, monkeypatch, 2, 8 + 150)
    versions = _versions(engine, 2)
    staging = Staging(engine.device)
    _update(engine, staging, versions[0], 1, "drain")
    sampling = Sampling(temperature=1.0, max_new_tokens=150, seed=1, ignore_eos=True, stop=("never said",))
    request = engine.submit([[3 + (i + k) % 13 for k in range(8)] for i in range(8)], sampling)
    deadline = time.monotonic() + 60
    while engine.core.scheduler.preempted == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    _update(engine, staging, versions[1], 2, "abort")
    results = request.wait(120)
    engine.close()
    aborted = [g for g in results if g.finish_reason == "abort"]
    assert aborted and all(len(g.logprobs) == len(g.output_ids) < 150 for g in aborted)
    assert all(g.versions == ((1, len(g.output_ids)),) for g in aborted if g.output_ids)
    assert all(g.versions == ((2, 150),) for g in results if g.finish_reason != "abort")


def test_preempted_rows_name_the_weights_of_every_token_across_pause_updates(tiny_model_dir, monkeypatch):
    """The pause check again, in a pool that keeps preempting rows (blocks for 8 tokens at
    admission, a pool of three whole rows): a row recomputed after an update went by carries on
    under the new weights, and its tokens still name the version that sampled each."""
    from services.rollout.builtin import core, scheduler

    monkeypatch.setattr(scheduler, "RESERVE_AHEAD", 8)
    monkeypatch.setattr(core.GenerationCore, "_cpu_blocks", lambda self, longest, rows: 3 * 3 + 1)
    preempted = []
    real = scheduler.Scheduler._preempt
    monkeypatch.setattr(scheduler.Scheduler, "_preempt", lambda self, k: (preempted.append(k), real(self, k)))
    check_pause_versions(tiny_model_dir, "cpu", tolerance=1e-4, min_spanning=2)  # (fewer rows run at once)
    assert len(preempted) >= 3
