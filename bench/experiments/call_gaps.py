"""A one-off experiment (2026-12-02): where a generate call leaves the GPU idle.

At 0.5B batch 256 the 1-token call (the prefill) took 34.5 ms against 23.3 ms of kernels, while
at 1.5B it took 75.7 against 74.8 (`bench/results/decode_kernels-*-5a584f6.jsonl`). This traces
one call of 1 and of 128 tokens per shape (CPU and CUDA, the scheduler's and runner's phases
marked), then prints the call's wall time, the GPU's busy time (the union of its kernels, copies
and memsets), and every stretch of more than 100 us in which the GPU ran nothing, with the
phases and host calls that ran during it.

    python bench/experiments/call_gaps.py [shapes] [batch]   # on a GPU
"""

from __future__ import annotations

import functools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import VOCAB, _Ids, make_model  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

GPU_KINDS = {"kernel", "gpu_memcpy", "gpu_memset"}
PHASES = {"runner": ("prefill", "_prefill_logits", "_record", "decode", "read", "outputs", "keep"),
          "scheduler": ("_admit", "_retire")}


def mark(core: GenerationCore) -> None:
    """Wrap the phases in profiler ranges (instance attributes; the classes stay as they are)."""
    for owner_name, names in PHASES.items():
        owner = getattr(core, owner_name)
        for name in names:
            method = getattr(owner, name)

            @functools.wraps(method)
            def wrapped(*args, _method=method, _name=f"phase:{owner_name}.{name}", **kwargs):
                with torch.profiler.record_function(_name):
                    return _method(*args, **kwargs)
            setattr(owner, name, wrapped)


def trace(core: GenerationCore, prompts: list[list[int]], sampling: Sampling) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("phase:call"):
            core.generate(prompts, sampling)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        return [e for e in json.load(open(f.name))["traceEvents"] if e.get("ph") == "X"]


def report(label: str, events: list[dict]) -> None:
    call = next(e for e in events if e["name"] == "phase:call")
    start, end = call["ts"], call["ts"] + call["dur"]
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_KINDS)
    busy, gaps, cursor = 0.0, [], start
    for s, e in gpu:
        if s > cursor:
            gaps.append((cursor, s))
        busy += max(0.0, e - max(s, cursor))
        cursor = max(cursor, e)
    if end > cursor:
        gaps.append((cursor, end))
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation", "cuda_driver")]
    idle = sum(b - a for a, b in gaps)
    print(f"# {label}: call {call['dur'] / 1e3:.2f} ms, GPU busy {busy / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms "
          f"in {len(gaps)} gaps, {sum(1 for a, b in gaps if b - a > 100)} over 100 us", flush=True)
    for a, b in sorted(gaps, key=lambda g: g[0]):
        if b - a <= 100:
            continue
        during: dict[str, float] = {}
        for e in host:
            overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if overlap > 20 and e["name"] != "phase:call":
                during[e["name"]] = during.get(e["name"], 0.0) + overlap
        top = sorted(during.items(), key=lambda kv: -kv[1])[:8]
        print(f"  gap at +{(a - start) / 1e3:8.2f} ms, {(b - a) / 1e3:6.2f} ms: "
              + ", ".join(f"{n[:48]} {us / 1e3:.2f}" for n, us in top), flush=True)


def main() -> None:
    shapes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["0.5b", "1.5b"]
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    for shape in shapes:
        model = make_model(shape, torch.bfloat16, "cuda")
        core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=batch))
        rng = random.Random(0)
        prompts = [[rng.randrange(VOCAB) for _ in range(64)] for _ in range(batch)]
        for new in (1, 128):
            sampling = Sampling(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=1)
            core.generate(prompts, sampling)  # compile, capture
            walls = []
            for _ in range(3):
                torch.cuda.synchronize()
                started = time.perf_counter()
                core.generate(prompts, sampling)
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - started)
            print(f"# {shape} b{batch} {new} tokens: unprofiled calls {[round(w * 1e3, 2) for w in walls]} ms, "
                  f"{core.scheduler.last_stats}", flush=True)
        mark(core)
        for new in (1, 128):
            sampling = Sampling(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=1)
            report(f"{shape} b{batch} {new} tokens (profiled)", trace(core, prompts, sampling))
        core = model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
