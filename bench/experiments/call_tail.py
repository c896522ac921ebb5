"""Experiment (2026-12-03, session 26): what the host does between the last hand-back of a
generate call and the call's return (0.76 ms on the H200's host in `host_phases.py`'s trace):
perf_counter marks (the hand-back's end, Scheduler.run's return, generate leaving inference
mode), a cProfile of just that tail, Python's collections in it, and what freeing a call's
leftovers costs. Found: 0.6-1.0 ms after generate left inference mode, which is the caller
dropping the results at once (freeing ~80k Python ints, floats and lists); results in
bench/results/call_tail-experiment-*.

    python bench/experiments/call_tail.py [shape] [batch]
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import _Ids, make_model  # noqa: E402
from services.rollout.builtin import scheduler as scheduler_module  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "0.5b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model(shape, torch.bfloat16 if device == "cuda" else torch.float32, device)
    core = GenerationCore(model, _Ids(), torch.device(device), CoreSettings(max_batch_size=batch))
    rng = random.Random(0)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(64)] for _ in range(batch)]
    sampling = Sampling(max_new_tokens=128 if device == "cuda" else 8, ignore_eos=True, seed=1)
    core.generate(prompts, sampling)
    state = {"profile": None}
    marks = {}
    plain_timed = scheduler_module._timed

    def timed(work):
        if state["profile"] is not None:
            state["profile"].disable()
        result = plain_timed(work)
        marks["hand_back_end"] = time.perf_counter()
        state["profile"] = cProfile.Profile()
        state["profile"].enable()
        return result

    scheduler_module._timed = timed
    plain_run = core.scheduler.run

    def run(*args, **kwargs):
        result = plain_run(*args, **kwargs)
        marks["run_returned"] = time.perf_counter()
        return result

    core.scheduler.run = run

    class Marked(torch.inference_mode):  # marks its exit's start and end
        def __exit__(self, *args):
            marks["mode_exit"] = time.perf_counter()
            super().__exit__(*args)
            marks["mode_exited"] = time.perf_counter()

    import services.rollout.builtin.core as core_module
    core_module.torch = type("T", (), {"inference_mode": Marked, "__getattr__": lambda self, n: getattr(torch, n)})()
    collections = []
    gc.callbacks.append(lambda phase, info: collections.append((phase, info["generation"], time.perf_counter())))
    for _ in range(4):
        if device == "cuda":
            torch.cuda.synchronize()
        state["profile"] = None
        started = time.perf_counter()
        core.generate(prompts, sampling)
        returned = time.perf_counter()
        state["profile"].disable()
        tail = [(p, g, round(1e3 * (t - marks["hand_back_end"]), 3)) for p, g, t in collections
                if t > marks["hand_back_end"]]
        collections.clear()
        print(f"# call {1e3 * (returned - started):.2f} ms; last hand-back to return "
              f"{1e3 * (returned - marks['hand_back_end']):.3f} ms (Scheduler.run returned after "
              f"{1e3 * (marks['run_returned'] - marks['hand_back_end']):.3f}, inference mode left "
              f"{1e3 * (marks['mode_exit'] - marks['hand_back_end']):.3f}-{1e3 * (marks['mode_exited'] - marks['hand_back_end']):.3f}); collections in that tail (phase, generation, ms): "
              f"{tail}", flush=True)
    pstats.Stats(state["profile"]).sort_stats("tottime").print_stats(14)
    # What freeing a finished call's leftovers costs: the outputs' pinned copies and their event,
    # and the rows' records.
    runner = core.runner
    for _ in range(3):
        copied = runner.outputs_async(list(range(batch)), [8] * batch, start=0)
        copied.append_to([([], []) for _ in range(batch)])
        started = time.perf_counter()
        del copied
        freed_copies = time.perf_counter() - started
        rows = [scheduler_module._Row(i, 0, prompts[i], [], 0, [1] * 128, [0.5] * 128) for i in range(batch)]
        started = time.perf_counter()
        del rows
        freed_rows = time.perf_counter() - started
        print(f"# freeing CopiedOutputs of {batch} rows {1e3 * freed_copies:.3f} ms, {batch} row records "
              f"{1e3 * freed_rows:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
