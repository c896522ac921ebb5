"""A one-off experiment (2026-12-03): where a generate call leaves the GPU idle, measured without
the CPU profiler (`call_gaps.py` traced every host op, which made the host's share look larger:
a profiled 1-token call took 32 ms against 27.7 unprofiled).

The host's phases are timed with `time.perf_counter` (wrappers on the scheduler's and runner's
methods, nothing else added); the GPU's kernels come from a CUDA-only trace of the same call. A
1-element fill launched as the call starts, while the device is idle, puts both on one clock.
Prints the call's wall time, the GPU's busy time, and every idle stretch over 50 us with the
host phases that ran during it.

    python bench/experiments/host_phases.py [shape] [batch]   # on a GPU
"""

from __future__ import annotations

import functools
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import VOCAB, _Ids, make_model  # noqa: E402
from services.rollout.builtin import runner as runner_module  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

GPU_KINDS = {"kernel", "gpu_memcpy", "gpu_memset"}
PHASES = {"runner": ("begin", "prefill", "start", "_prefill_logits", "_record", "decode", "read", "outputs_async",
                     "keep", "mark"),  # (phases a version lacks are left out: "mark" is 2e8ab2e's)
          "scheduler": ("_admit", "_retire")}
MARK = 0.25  # the value the marker fill writes


def wrap(core: GenerationCore, spans: list) -> None:
    """Record (name, start, end) host spans of the phases (instance attributes only)."""
    for owner_name, names in PHASES.items():
        owner = getattr(core, owner_name)
        for name in names:
            method = getattr(owner, name, None)
            if method is None:  # (another version of the engine)
                continue

            @functools.wraps(method)
            def wrapped(*args, _method=method, _name=f"{owner_name}.{name}", **kwargs):
                started = time.perf_counter()
                try:
                    result = _method(*args, **kwargs)
                finally:
                    spans.append((_name, started, time.perf_counter()))
                if callable(result) and _name in ("scheduler._retire", "runner.outputs_async"):
                    inner = result

                    def timed_result(*a, _inner=inner, _n=_name + "()", **k):
                        s = time.perf_counter()
                        try:
                            return _inner(*a, **k)
                        finally:
                            spans.append((_n, s, time.perf_counter()))
                    return timed_result
                return result
            setattr(owner, name, wrapped)
    copied = getattr(runner_module, "CopiedOutputs", None)
    for name in ("wait", "append_to") if copied is not None else ():
        method = getattr(copied, name)

        @functools.wraps(method)
        def timed(self, *args, _method=method, _name=f"copied.{name}"):
            started = time.perf_counter()
            try:
                return _method(self, *args)
            finally:
                spans.append((_name, started, time.perf_counter()))
        setattr(copied, name, timed)


def watch_replays_and_gc(spans: list) -> None:
    """Host spans of every CUDA graph replay and garbage collection too."""
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(self, _replay=replay):
        started = time.perf_counter()
        _replay(self)
        spans.append(("graph.replay", started, time.perf_counter()))
    torch.cuda.CUDAGraph.replay = timed_replay
    began = []

    def collected(phase, info):
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            spans.append((f"gc{info['generation']}", began.pop(), time.perf_counter()))
    gc.callbacks.append(collected)


def one_call(core: GenerationCore, prompts, sampling, marker: torch.Tensor, spans: list) -> tuple[float, float]:
    torch.cuda.synchronize()
    spans.clear()
    started = time.perf_counter()
    marker.fill_(MARK)
    core.generate(prompts, sampling)
    returned = time.perf_counter()
    torch.cuda.synchronize()
    return started, returned


def print_spans(label: str, started: float, returned: float, spans: list) -> None:
    host = sorted(((n, (s - started) * 1e3, (f - started) * 1e3) for n, s, f in spans), key=lambda h: h[1])
    print(f"  {label}: returned at {(returned - started) * 1e3:.2f} ms; " + ", ".join(
        f"{n} {s:.2f}-{f:.2f}" for n, s, f in host if f - s > 0.05 or n.startswith("gc")), flush=True)


def traced(core, prompts, sampling, marker, spans) -> tuple[list[dict], float, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started, returned = one_call(core, prompts, sampling, marker, spans)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = [e for e in json.load(open(f.name))["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_KINDS]
    return sorted(events, key=lambda e: e["ts"]), started, returned


def report(label: str, events: list[dict], started: float, returned: float, spans: list) -> None:
    first = events[0]  # the marker fill
    t0 = first["ts"]  # GPU clock (us) at the host's `started`
    end = (returned - started) * 1e6
    busy, gaps, cursor = 0.0, [], 0.0
    for e in events[1:]:
        s, f = e["ts"] - t0, e["ts"] - t0 + e["dur"]
        if s > cursor:
            gaps.append((cursor, s))
        busy += max(0.0, f - max(s, cursor))
        cursor = max(cursor, f)
    if end > cursor:
        gaps.append((cursor, end))
    idle = sum(b - a for a, b in gaps)
    print(f"# {label} (marker: {first['name'][:40]}): call {end / 1e3:.2f} ms (host returned), "
          f"GPU busy {busy / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms in {len(gaps)} gaps, "
          f"last GPU work ends at {cursor / 1e3:.2f} ms", flush=True)
    host = [(n, (s - started) * 1e6, (f - started) * 1e6) for n, s, f in spans]
    for a, b in gaps:
        if b - a <= 50:
            continue
        during: dict[str, float] = {}
        for n, s, f in host:
            overlap = min(b, f) - max(a, s)
            if overlap > 5:
                during[n] = during.get(n, 0.0) + overlap
        top = sorted(during.items(), key=lambda kv: -kv[1])[:8]
        print(f"  idle at +{a / 1e3:8.2f} ms for {(b - a) / 1e3:6.2f} ms: "
              + ", ".join(f"{n} {us / 1e3:.2f}" for n, us in top), flush=True)
    totals: dict[str, list[float]] = {}
    for n, s, f in host:
        totals.setdefault(n, []).append(f - s)
    print("  host phases (ms, all calls summed): " + ", ".join(
        f"{n} {sum(v) / 1e3:.2f} x{len(v)}" for n, v in sorted(totals.items(), key=lambda kv: -sum(kv[1]))), flush=True)
    print("  host phase spans (start-end ms): " + ", ".join(
        f"{n} {s / 1e3:.2f}-{f / 1e3:.2f}" for n, s, f in host if f - s > 100), flush=True)


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "0.5b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    model = make_model(shape, torch.bfloat16, "cuda")
    core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=batch))
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(64)] for _ in range(batch)]
    marker = torch.zeros(1, device="cuda")
    spans: list = []
    for new in (1, 128):
        sampling = Sampling(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=1)
        core.generate(prompts, sampling)  # compile, capture
        walls = []
        for _ in range(5):
            started, _ = one_call(core, prompts, sampling, marker, spans)
            walls.append(time.perf_counter() - started)
        print(f"# {shape} b{batch} {new} tokens: unprofiled calls {[round(w * 1e3, 2) for w in walls]} ms", flush=True)
    wrap(core, spans)
    watch_replays_and_gc(spans)
    for new in (1, 128):
        sampling = Sampling(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=1)
        for _ in range(3):
            started, returned = one_call(core, prompts, sampling, marker, spans)
            print(f"# {shape} b{batch} {new} tokens, phases timed: {(time.perf_counter() - started) * 1e3:.2f} ms",
                  flush=True)
            print_spans("host spans over 50 us (ms from the call's start)", started, returned, spans)
        events, started, returned = traced(core, prompts, sampling, marker, spans)
        report(f"{shape} b{batch} {new} tokens (CUDA trace)", events, started, returned, spans)


if __name__ == "__main__":
    main()
