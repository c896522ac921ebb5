"""Where a GPU decode step's time goes, kernel by kernel, with the graphs the engine replays.

For each shape and batch: the step's wall time (from calls making 1 and 33 tokens), and every
kernel of the step (kernels of the 33-token call minus the 1-token call's, over 32 steps, as
CUPTI records them inside graph replays): calls per step, microseconds per step. What the kernels
do not cover is launch gaps and host time. Also reports the step's bytes at the streaming read
bandwidth measured in the same run (the roofline of `bench/rollout.py`).

    python bench/decode_kernels.py --shapes 0.5b --batches 16,256 --json --out run.jsonl && python bench/common.py publish decode_kernels run.jsonl
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from bench.rollout import VOCAB, _Ids, _stamp, kv_bytes_per_token, make_model, read_bandwidth, timed, weight_bytes  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

PROMPT = 64
STEPS = 32


def kernels(core: GenerationCore, prompts: list[list[int]], new_tokens: int) -> dict[str, list[float]]:
    """name -> [calls, microseconds] over one generate call."""
    from torch.profiler import ProfilerActivity, profile

    sampling = Sampling(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        core.generate(prompts, sampling)
        torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type.name != "CUDA":
            continue
        us = getattr(event, "device_time", 0.0) or getattr(event, "cuda_time", 0.0)
        entry = out[event.name[:90]]
        entry[0] += 1
        entry[1] += us
    return out


def profile_step(shape: str, batch: int, bandwidth: float) -> dict:
    model = make_model(shape, torch.bfloat16, "cuda")
    core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=batch))
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT)] for _ in range(batch)]
    one = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=1)
    many = Sampling(temperature=1.0, max_new_tokens=STEPS + 1, ignore_eos=True, seed=1)
    core.generate(prompts, many)  # warm: compiles, captures
    wall = []
    for _ in range(3):
        wall.append((timed(lambda: core.generate(prompts, many), "cuda") - timed(lambda: core.generate(prompts, one), "cuda")) / STEPS)
    step_s = sorted(wall)[1]
    first, full = kernels(core, prompts, 1), kernels(core, prompts, STEPS + 1)
    rows = []
    for name, (calls, us) in full.items():
        calls0, us0 = first.get(name, [0, 0.0])
        if calls - calls0 > 0:
            rows.append({"kernel": name, "calls": round((calls - calls0) / STEPS, 2), "us": round((us - us0) / STEPS, 2)})
    rows.sort(key=lambda r: -r["us"])
    prefill = sorted(({"kernel": name, "calls": calls, "us": round(us, 1)} for name, (calls, us) in first.items()),
                     key=lambda r: -r["us"])
    prefill_s = timed(lambda: core.generate(prompts, one), "cuda")
    busy_us = sum(r["us"] for r in rows)
    mean_context = PROMPT + STEPS / 2
    step_bytes = weight_bytes(model) + batch * mean_context * kv_bytes_per_token(model)
    return _stamp({
        "bench": "decode_kernels", "shape": shape, "batch": batch,
        "step_us": round(1e6 * step_s, 1), "kernels_us": round(busy_us, 1), "gaps_us": round(1e6 * step_s - busy_us, 1),
        "roofline_us": round(1e6 * step_bytes / bandwidth, 1), "decode_ratio": round(step_bytes / bandwidth / step_s, 4),
        "launches": round(sum(r["calls"] for r in rows), 1), "top": rows[:25],
        "prefill_call_us": round(1e6 * prefill_s, 1), "prefill_kernels_us": round(sum(r["us"] for r in prefill), 1),
        "prefill_top": prefill[:12],
    })


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--batches", default="16,256")
    parser.add_argument("--json", action="store_true", help="(the lines are JSON either way)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_kernels: needs a CUDA GPU (it profiles the Triton kernels of a decode step)", file=sys.stderr)
        return 2
    bandwidth = read_bandwidth("cuda")
    for shape in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            line = profile_step(shape, batch, bandwidth)
            torch.cuda.empty_cache()  # the step's model and KV pool went with profile_step's frame
            emit(line, args.out)
            print(f"# {shape} b{batch}: step {line['step_us']} us, kernels {line['kernels_us']} us, "
                  f"roofline {line['roofline_us']} us; prefill call {line['prefill_call_us']} us, "
                  f"its kernels {line['prefill_kernels_us']} us", file=sys.stderr, flush=True)
            for row in line["top"][:12]:
                print(f"#   {row['us']:8.1f} us  {row['calls']:6.1f}x  {row['kernel']}", file=sys.stderr, flush=True)
            for row in line["prefill_top"][:6]:
                print(f"#   prefill {row['us']:8.1f} us  {row['calls']:4d}x  {row['kernel']}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
