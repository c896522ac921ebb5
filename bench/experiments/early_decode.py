"""A screening experiment (2026-12-03, session 22, not yet run on a GPU): in RL-shaped calls, queue
the next round's decode steps before handing finished rows back and packing the rest, in the
rounds where no admission is due.

Why: with stop tokens the host reads the rows' state every `check_every` steps (a sync). After
the read it retires the finished rows (copies queued, blocks freed) and packs the rest (an index
upload and ~20 small kernels), then queues the next steps: ~0.3-0.5 ms of host time a round with
the device idle, over ~420 rounds in a 0.5B RL-shaped call (estimate, from its `host_s`). Where
no prompt will be admitted this round, nothing needs the packing before the next steps: finished
rows are done and inert in them (they record nothing), their outputs do not change, and the
packing and the copies are queued after those steps on the same stream, so they act on the state
the steps leave. Unlike a fully pipelined scheduler this delays no admission. The cost: the steps
run at the unpacked batch's bucket for one more round.

    python bench/experiments/early_decode.py check        # CPU: the same results as the scheduler
    python bench/experiments/early_decode.py [shapes]     # GPU: RL-shaped calls, variants alternating
"""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import _Ids, make_model, timed  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.builtin.runner import StepMode  # noqa: E402
from services.rollout.builtin.scheduler import (CallStats, GenerationCancelled, Scheduler, _Row,  # noqa: E402
                                                _timed, _Waiting)
from services.rollout.types import Generation, Sampling  # noqa: E402


class EarlyDecodeScheduler(Scheduler):
    """`Scheduler` whose stop-token rounds queue the next decode steps before retiring and
    packing when no admission is due (stop strings keep the plain order: they need the tokens)."""

    def _admission_due(self, waiting: deque, num_rows: int) -> bool:
        """Whether `_admit` would try to admit with `num_rows` rows running (its own test)."""
        if not waiting:
            return False
        free = self.runner.capacity - num_rows
        return num_rows == 0 or free >= min(self.runner.capacity // 4, sum(len(w.samples) for w in waiting))

    def run(self, prompts_ids: list[list[int]], sampling_: Sampling, stop_ids: set[int], seed: int,
            cancelled: Callable[[], bool] | None = None) -> list[Generation]:
        n = sampling_.n
        greedy = sampling_.temperature == 0
        mode = StepMode(greedy=greedy, top_k=0 if greedy else sampling_.top_k, top_p=not greedy and sampling_.top_p < 1)
        self.runner.begin(temperature=sampling_.temperature, top_p=sampling_.top_p,
                          max_new_tokens=sampling_.max_new_tokens, stop_ids=stop_ids)
        waiting = deque(_Waiting(i, p if type(p) is list else list(p), list(range(n)))
                        for i, p in enumerate(prompts_ids))
        rows: list[_Row] = []
        results: list[Generation | None] = [None] * (len(prompts_ids) * n)
        made: list[int] = []
        can_stop = bool(stop_ids or sampling_.stop)
        early = can_stop and not sampling_.stop
        rounds = steps = prefills = max_rows = 0
        prefill_s = decode_s = host_s = 0.0
        pending: list[Callable[[], float]] = []
        queued = 0  # steps already queued for this round (the round before queued them early)
        self.early_rounds = 0
        try:
            while waiting or rows:
                if cancelled is not None and cancelled():
                    raise GenerationCancelled("generate: the caller cancelled")
                started = time.perf_counter()
                admitted = 0 if queued else self._admit(waiting, rows, seed, sampling_.max_new_tokens, mode)
                admitted_at = time.perf_counter()
                prefill_s += admitted_at - started
                prefills += admitted
                made += [1] * (len(rows) - len(made))
                max_rows = max(max_rows, len(rows))
                if not queued:
                    todo = self._steps_before_check(made, sampling_.max_new_tokens, can_stop)
                    if todo > 0:
                        self.runner.decode(len(rows), todo, mode)
                        steps += todo
                queued = 0
                for work in pending:
                    spent, waited = _timed(work)
                    host_s += spent - waited
                    decode_s += waited
                    admitted_at += spent
                pending = []
                if can_stop:
                    done, made = self.runner.read(len(rows))
                    stopped = self._stop_strings(rows, made, done, sampling_.stop) if sampling_.stop else {}
                    finished = [k for k in range(len(rows)) if done[k] or k in stopped]
                else:
                    stopped, made = {}, [m + todo for m in made]
                    finished = [k for k, m in enumerate(made) if m >= sampling_.max_new_tokens]
                    if not finished:
                        if rows:
                            pending.append(self._outputs_so_far(rows, made))
                        rounds += 1
                        decode_s += time.perf_counter() - admitted_at
                        continue
                read_at = time.perf_counter()
                decode_s += read_at - admitted_at
                if finished:
                    finished_set = set(finished)
                    keep = [k for k in range(len(rows)) if k not in finished_set]
                    if early and keep and not self._admission_due(waiting, len(keep)):
                        # the next steps first, on the unpacked rows (the finished ones done and inert)
                        queued = self._steps_before_check([made[k] for k in keep], sampling_.max_new_tokens, can_stop)
                        if queued > 0:
                            self.runner.decode(len(rows), queued, mode)
                            steps += queued
                            self.early_rounds += 1
                    pending.append(self._retire(rows, finished, made, stopped, stop_ids, results, n))
                    self.runner.keep(keep)
                    rows = [rows[k] for k in keep]
                    made = [made[k] for k in keep]
                rounds += 1
                host_s += time.perf_counter() - read_at
            for work in pending:
                spent, waited = _timed(work)
                host_s += spent - waited
                decode_s += waited
        finally:
            for row in rows:
                self.cache.allocator.free(row.blocks)
        self.last_stats = CallStats(rounds, steps, prefills, max_rows, prefill_s, decode_s, host_s)
        return results  # type: ignore[return-value]


def check() -> None:
    """CPU: the same tokens, logprobs and finish reasons as the scheduler, with stop tokens, n > 1,
    more rows than slots (admissions between rounds) and rounds that queue early."""
    model = make_model("tiny", torch.float32, "cpu")
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 40))] for _ in range(12)]
    for batch, check_every in ((8, 1), (5, 4), (64, 2)):
        sampling = Sampling(temperature=1.0, max_new_tokens=48, n=3, seed=7,
                            stop_token_ids=tuple(rng.sample(range(vocab), vocab // 20)))
        core = GenerationCore(model, _Ids(), torch.device("cpu"), CoreSettings(max_batch_size=batch,
                                                                                 check_every=check_every))
        plain = core.generate(prompts, sampling)
        core.scheduler.__class__ = EarlyDecodeScheduler
        got = core.generate(prompts, sampling)
        same = [(a.output_ids, a.finish_reason) for a in plain] == [(b.output_ids, b.finish_reason) for b in got]
        # (logprobs to float32 rounding: a step's batch is larger in the round that queues early)
        diff = max(abs(x - y) for a, b in zip(plain, got) for x, y in zip(a.logprobs, b.logprobs))
        same = same and diff < 1e-4
        free = core.cache.allocator.num_free == core.cache.allocator.num_blocks - 1
        print(f"batch {batch} check_every {check_every}: same tokens and finish reasons {same} (logprobs within "
              f"{diff:.1e}), early rounds {core.scheduler.early_rounds}, blocks all back {free}", flush=True)
        assert same and free and core.scheduler.early_rounds > 0


def main() -> None:
    if sys.argv[1:] == ["check"]:
        check()
        return
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["0.5b"]
    for shape in shapes:
        model = make_model(shape, torch.bfloat16, "cuda")
        vocab = model.config.vocab_size
        rng = random.Random(1)  # as bench/rollout.py's RL-shaped run
        stops = tuple(rng.sample(range(vocab), vocab // 300))
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(64, 512))] for _ in range(256)]
        sampling = Sampling(temperature=1.0, max_new_tokens=1024, n=8, seed=3, stop_token_ids=stops)
        core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=256))
        core.generate(prompts, sampling)  # compile, capture
        for _round in range(2):
            for name, cls in (("plain", Scheduler), ("early", EarlyDecodeScheduler)):
                core.scheduler.__class__ = cls
                results = []
                seconds = timed(lambda: results.extend(core.generate(prompts, sampling)), "cuda")
                tokens = sum(len(r.output_ids) for r in results)
                print(f"{shape} {name:6s} {tokens / seconds:9.1f} tokens/s ({tokens} tokens, {seconds:.3f} s) "
                      f"early rounds {getattr(core.scheduler, 'early_rounds', 0)} {core.scheduler.last_stats}",
                      flush=True)
        core = model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
