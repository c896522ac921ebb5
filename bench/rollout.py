"""Rollout speed against the decode roofline measured in the same run, and the on-policy gap.

The decode roofline is the tokens/s a device could give if each decode step only had to read
the bytes it needs (every weight once, plus the live KV cache of every row) at the streaming
read bandwidth measured here (`read_bandwidth`: sums over a 4 GB tensor, the faster of torch's
and a read-only kernel's). `ratio` is measured tokens/s over it.
Prints JSON lines and, with --png, plots them.

- `sweep`: random bf16 weights, 64-token prompts, ignore_eos, 128 new tokens, at batch 1, 16, 64
  and 256, on the 0.5B and 1.5B Qwen2 shapes (hidden 896 / 1536, tied 151936-token vocabulary);
  tokens/s counts generated tokens over the whole call (prefill included); `decode_ms` is one
  decode step, from the same call with 1 and 128 new tokens. `split_ms` says where a step's GPU
  time goes (matrix products, attention, the small kernels, sampling), from one profiled step;
  `idle_ms` where the 128-token call leaves the device idle (before its first kernel, between
  kernels, after its last until the call returns: the host's share), from a CUDA-only trace.
- `rl`: 256 prompts x n=8, prompts of 64-512 tokens, up to 1024 new tokens. Random weights
  never say eos, so 1/300 of the vocabulary are stop tokens: lengths are geometric with mean
  ~300, 3% reach 1024. Timed on the second call (the first, `first_call_s`, compiles kernels
  and captures graphs); `after_release_s` is a third call after `release()`, as a colocated
  engine makes every step (KV pool and graphs made again). The eager reference engine's figure
  comes from the first 32 prompts (256 rows, one batch), in the same run.
- `gap`: |engine logprob - trainer logprob| for the same tokens (the trainer's full forward),
  mean and max, in bf16 and float32.

    python bench/rollout.py --device cuda --json --out bench/results/rollout-nvidia-h200.jsonl --png bench/results/rollout-nvidia-h200.png
    python bench/rollout.py --device cpu --shapes tiny --json     # CPU: a small shape only
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import commit, emit, machine  # noqa: E402
from services.models import DecoderLM, ModelConfig  # noqa: E402
from services.rollout import torch_engine  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, head_dim=64),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, head_dim=128),
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64),
}
VOCAB = 151936


class _Ids:
    """The tokenizer an engine needs here: ids only (no text is looked at)."""

    pad_token_id = 0

    def __init__(self, eos: int | None = None):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""

    def decode_batch(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return [""] * len(batch)


def make_model(shape: str, dtype: torch.dtype, device: str) -> DecoderLM:
    config = ModelConfig(architecture="qwen2", vocab_size=VOCAB if shape != "tiny" else 32000,
                         tie_word_embeddings=True, max_position_embeddings=4096, **SHAPES[shape])
    with torch.device("meta"):
        model = DecoderLM(config)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=generator)
    return model.eval()


def read_bandwidth(device: str) -> float:
    """Bytes/s this device streams reads at: on a GPU the faster of two sums over 4 GB, torch's
    and a read-only Triton kernel (`read_kernel.py`), each the median of 20 timed by CUDA
    events (each queued behind an untimed one, so no launch gap is timed) after half a second
    of sums (an idle GPU starts at a low clock); on a CPU a sum over 256 MB, the median of 5
    after one.

    Why both, timed so: on an H200, torch's sum alone timed on the host (the median of 5 after
    one) gave 4.10, 4.18 and 3.92 TB/s in three readings in one process, while after a warm-up
    torch's sum read 4.11-4.19 and the read kernel 4.49-4.53; this measure reads 4.531, 4.531
    and 4.530 (docs/design/engine-tuning.md)."""
    if device == "cpu":
        x = torch.ones((256 << 20) // 2, dtype=torch.bfloat16)
        times = []
        for _ in range(6):
            start = time.perf_counter()
            x.sum()
            times.append(time.perf_counter() - start)
        return x.numel() * 2 / sorted(times[1:])[2]
    from bench.read_kernel import read_sum

    x = torch.ones((4 << 30) // 2, dtype=torch.bfloat16, device=device)
    kernel = read_sum(x)
    warm_until = time.perf_counter() + 0.5
    while time.perf_counter() < warm_until:
        x.sum()
        kernel()
        torch.cuda.synchronize(device)
    best = 0.0
    for fn in (x.sum, kernel):
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn()  # untimed: the device is busy with it while the timed one is launched
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        best = max(best, x.numel() * 2 / sorted(times)[10])
    del x
    return best


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def weight_bytes(model: DecoderLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(model: DecoderLM) -> int:
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * model.model.embed_tokens.weight.element_size()


def timed(fn, device: str) -> float:
    """Seconds fn() takes, its device work included. What it returns is freed after the clock
    stops: freeing a 256-row call's results (256 x 128 tokens and logprobs as Python objects)
    took 0.6-1.0 ms on an H200 machine's host, the caller's cost whenever it drops them, not the
    call's."""
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    seconds = time.perf_counter() - start
    del result
    return seconds


def sweep(shape: str, batches: list[int], device: str, bandwidth: float, args) -> list[dict]:
    model = make_model(shape, torch.bfloat16, device)
    wbytes, kv_token = weight_bytes(model), kv_bytes_per_token(model)
    core = GenerationCore(model, _Ids(), torch.device(device), CoreSettings(max_batch_size=max(batches)))
    rng = random.Random(0)
    prompt_len, new = 64, args.new_tokens
    timed_lines, lines = [], []
    for batch in batches:
        prompts = [[rng.randrange(VOCAB if shape != "tiny" else 32000) for _ in range(prompt_len)] for _ in range(batch)]
        full = Sampling(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=1)
        one = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=1)
        core.generate(prompts, full)  # warm-up: kernels compile, graphs are captured
        seconds = sorted(timed(lambda: core.generate(prompts, full), device) for _ in range(args.repeats))[args.repeats // 2]
        prefill = sorted(timed(lambda: core.generate(prompts, one), device) for _ in range(args.repeats))[args.repeats // 2]
        decode_s = (seconds - prefill) / (new - 1)
        # bytes a decode step must read: the weights, and every row's KV (mean context over the run)
        mean_context = prompt_len + (new - 1) / 2
        step_bytes = wbytes + batch * mean_context * kv_token
        roofline = batch / (step_bytes / bandwidth)
        tokens_per_s = batch * new / seconds
        line = {
            "bench": "rollout", "kind": "sweep", "shape": shape, "batch": batch, "prompt_len": prompt_len,
            "new_tokens": new, "tokens_per_s": round(tokens_per_s, 1), "roofline_tokens_per_s": round(roofline, 1),
            "ratio": round(tokens_per_s / roofline, 4), "decode_ms": round(1e3 * decode_s, 4),
            "decode_ratio": round(batch / decode_s / roofline, 4), "prefill_ms": round(1e3 * prefill, 3),
            "read_tb_s": round(bandwidth / 1e12, 3), "weight_gb": round(wbytes / 1e9, 3),
            "graphs": core.runner.use_graphs, "ops": core.ops.name,
        }
        timed_lines.append((_stamp(line), prompts))
        print(f"# {shape} batch {batch}: {line['tokens_per_s']} tokens/s ({line['ratio']} of the roofline)",
              file=sys.stderr, flush=True)
    # Profiled only once every batch is timed, so that no timing follows a profiler session
    # (measured on an H200, one costs the calls after it up to ~1%: docs/design/engine-tuning.md).
    for line, prompts in timed_lines:
        if device != "cpu" and args.profile:
            line["split_ms"] = step_split(core, prompts)
            try:
                line["idle_ms"] = device_idle(core, prompts, new)
            except Exception as exc:  # a trace this torch cannot give loses that field, not the sweep
                print(f"# idle_ms left out: {exc!r}", file=sys.stderr, flush=True)
        emit(line, args.out)
        lines.append(line)
    core = model = None  # (not del: the timing lambdas above name them)
    if device != "cpu":
        torch.cuda.empty_cache()
    return lines


# Kernel kinds by name (the first that matches): attention before products, since cuDNN's SDPA
# kernels carry "sm90_" as cuBLAS's do.
KERNEL_KINDS = (
    ("attention", ("attention", "flash", "sdpa", "decode_split", "decode_merge")),
    ("matmul", ("gemm", "gemv", "cutlass", "sm90_", "matmul", "splitk", "skinny_linear", "tile_linear")),
    ("sampling", ("sample",)),
    ("norm_rope_silu", ("rmsnorm", "rope", "silu")),
)


def kernel_kind(name: str) -> str:
    """Which of `split_ms`'s kinds a kernel's time goes to ("other" for none)."""
    name = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(key in name for key in keys)), "other")


def idle_split(activity: list[tuple[float, float]], call_us: float) -> dict[str, float]:
    """Device idle time of a call (ms) from its GPU activity [(start, end) us], the first entry
    the marker launched as the call started (the device idle, so it ran then): before the first
    kernel after it, between kernels, and after the last one until the call returned at call_us
    (on the marker's clock: its start is 0)."""
    origin = activity[0][0]
    spans = sorted((a - origin, b - origin) for a, b in activity[1:])
    busy = between = 0.0
    cursor = activity[0][1] - origin
    first = spans[0][0] - cursor if spans else call_us - cursor
    for index, (a, b) in enumerate(spans):
        if index and a > cursor:
            between += a - cursor
        busy += max(0.0, b - max(a, cursor))
        cursor = max(cursor, b)
    return {"busy": round(busy / 1e3, 3), "before_first_kernel": round(max(0.0, first) / 1e3, 3),
            "between_kernels": round(between / 1e3, 3), "after_last_kernel": round(max(0.0, call_us - cursor) / 1e3, 3)}


def device_idle(core: GenerationCore, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """`idle_split` of one call, from a CUDA-only trace (no host ops traced, so the host runs as
    it does unprofiled). A 1-element fill launched as the call starts, while the device is idle,
    puts the host's clock and the trace's on one line."""
    from torch.profiler import ProfilerActivity, profile

    sampling = Sampling(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=1)
    marker = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        marker.fill_(1.0)
        core.generate(prompts, sampling)
        returned = time.perf_counter()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.load(open(trace.name))["traceEvents"]
    activity = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                      if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    return idle_split(activity, (returned - started) * 1e6)


def step_split(core: GenerationCore, prompts: list[list[int]]) -> dict:
    """GPU time of one decode step by kernel kind (ms): kernels of a call making 9 tokens minus
    those of a call making 1 (the prefill), over the 8 steps between, run without graphs."""
    from torch.profiler import ProfilerActivity, profile

    def kinds(new_tokens: int) -> dict[str, float]:
        sampling = Sampling(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=1)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            core.generate(prompts, sampling)
            torch.cuda.synchronize()
        out = {"matmul": 0.0, "attention": 0.0, "sampling": 0.0, "norm_rope_silu": 0.0, "other": 0.0}
        for event in prof.key_averages():
            us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
            if event.device_type.name != "CUDA" or not us:
                continue
            out[kernel_kind(event.key)] += us
        return out

    runner = core.runner
    runner.use_graphs = False
    try:
        kinds(9)  # warm
        one, nine = kinds(1), kinds(9)
        eager = (timed(lambda: core.generate(prompts, Sampling(max_new_tokens=9, ignore_eos=True, seed=1)), "cuda")
                 - timed(lambda: core.generate(prompts, Sampling(max_new_tokens=1, ignore_eos=True, seed=1)), "cuda")) / 8
    finally:
        runner.use_graphs = True
    split = {k: round((nine[k] - one[k]) / 8 / 1e3, 4) for k in one}
    split["kernels_total"] = round(sum(split.values()), 4)
    split["eager_step"] = round(1e3 * eager, 4)
    return split


def rl_run(shape: str, device: str, args) -> list[dict]:
    model = make_model(shape, torch.bfloat16, device)
    vocab = model.config.vocab_size
    rng = random.Random(1)
    stops = tuple(rng.sample(range(vocab), vocab // 300))
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(64, 512))] for _ in range(args.rl_prompts)]
    sampling = Sampling(temperature=1.0, max_new_tokens=1024, n=8, seed=3, stop_token_ids=stops)
    core = GenerationCore(model, _Ids(), torch.device(device), CoreSettings(max_batch_size=256))
    # The first call compiles kernels and captures a graph per batch bucket and prefill shape it
    # meets (seconds of work an engine does once); the second is the steady state an RL job sees.
    first = timed(lambda: core.generate(prompts, sampling), device)
    results = []
    seconds = timed(lambda: results.extend(core.generate(prompts, sampling)), device)
    tokens = sum(len(r.output_ids) for r in results)
    stats = core.scheduler.last_stats
    # A colocated engine releases its KV pool and graphs every RL step (the trainer takes the
    # memory), so its next call makes the pool and captures the graphs again.
    core.release()
    after_release = timed(lambda: core.generate(prompts, sampling), device)
    line = {"bench": "rollout", "kind": "rl", "shape": shape, "engine": "paged", "prompts": len(prompts), "n": 8,
            "rows": len(results), "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
            "first_call_s": round(first, 3), "after_release_s": round(after_release, 3),
            "mean_len": round(tokens / len(results), 1), "truncated": sum(len(r.output_ids) == 1024 for r in results),
            "decode_steps": stats.decode_steps, "prefills": stats.prefills, "prefill_s": round(stats.prefill_s, 3),
            "decode_s": round(stats.decode_s, 3), "host_s": round(stats.host_s, 3)}
    emit(_stamp(line), args.out)
    out = [line]
    if args.old_prompts:
        subset = prompts[: args.old_prompts]
        old = []
        with torch.inference_mode():
            seconds = timed(lambda: old.extend(torch_engine.generate(model, _Ids(), subset, sampling, max_batch_size=256,
                                                                     device=device)), device)
        tokens = sum(len(r.output_ids) for r in old)
        line = {"bench": "rollout", "kind": "rl", "shape": shape, "engine": "eager (before)", "prompts": len(subset),
                "n": 8, "rows": len(old), "tokens": tokens, "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1), "mean_len": round(tokens / len(old), 1)}
        emit(_stamp(line), args.out)
        out.append(line)
    core = model = None  # (not del: the timing lambdas above name them)
    if device != "cpu":
        torch.cuda.empty_cache()
    return out


def gap(shape: str, device: str, dtype: torch.dtype, args) -> dict:
    """Engine logprobs of sampled tokens against the trainer's full forward of the same sequences."""
    model = make_model(shape, dtype, device)
    vocab = model.config.vocab_size
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 128))] for _ in range(16)]
    core = GenerationCore(model, _Ids(), torch.device(device), CoreSettings(max_batch_size=64))
    results = core.generate(prompts, Sampling(temperature=1.0, max_new_tokens=64, n=2, seed=4, ignore_eos=True))
    diffs = []
    with torch.inference_mode():
        for r in results:
            ids = torch.tensor([r.prompt_ids + r.output_ids], device=device)
            logits = model(ids)[0, len(r.prompt_ids) - 1 : -1].float()  # as losses.gather_logprobs does
            trainer = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(r.prompt_ids):, None]).squeeze(1)
            diffs.append((trainer - torch.tensor(r.logprobs, device=device)).abs())
    allowed = torch.cat(diffs)
    line = _stamp({"bench": "rollout", "kind": "gap", "shape": shape, "dtype": str(dtype).removeprefix("torch."),
                   "tokens": allowed.numel(), "mean_abs": float(allowed.mean()), "max_abs": float(allowed.max())})
    emit(line, args.out)
    del core, model
    return line


def _stamp(line: dict) -> dict:
    return {**line, "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine()}


def plot(lines: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in sorted({l["shape"] for l in lines if l["kind"] == "sweep"}):
        rows = [l for l in lines if l["kind"] == "sweep" and l["shape"] == shape]
        batches = [l["batch"] for l in rows]
        line, = ax.plot(batches, [l["tokens_per_s"] for l in rows], "o-", label=f"{shape}: rlfleet engine")
        ax.plot(batches, [l["roofline_tokens_per_s"] for l in rows], "--", color=line.get_color(),
                label=f"{shape}: decode roofline")
        for l in rows:
            ax.annotate(f"{l['ratio']:.2f}", (l["batch"], l["tokens_per_s"]), textcoords="offset points", xytext=(4, -10),
                        fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (rows decoded together)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"rollout vs decode roofline ({lines[0]['machine']}, {lines[0]['commit']})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="sweep,rl,gap", help="which of sweep, rl, gap to run")
    parser.add_argument("--rl-prompts", type=int, default=256)
    parser.add_argument("--old-prompts", type=int, default=32, help="prompts the eager engine runs in `rl` (0: none)")
    parser.add_argument("--rl-shapes", default="0.5b,1.5b")
    parser.add_argument("--no-profile", dest="profile", action="store_false")
    parser.add_argument("--json", action="store_true", help="(the lines are JSON either way)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    parts = args.parts.split(",")
    bandwidth = read_bandwidth(args.device)
    print(f"# streaming read {bandwidth / 1e12:.2f} TB/s on {machine()}", file=sys.stderr, flush=True)
    lines: list[dict] = []
    if "sweep" in parts:
        for shape in args.shapes.split(","):
            lines += sweep(shape, [int(b) for b in args.batches.split(",")], args.device, bandwidth, args)
    if "rl" in parts:
        for i, shape in enumerate(args.rl_shapes.split(",")):
            if i > 0:
                args.old_prompts = 0  # the eager engine's figure once (its steps are slow)
            lines += rl_run(shape, args.device, args)
    if "gap" in parts:
        for dtype in (torch.bfloat16, torch.float32):
            lines.append(gap(args.shapes.split(",")[0], args.device, dtype, args))
    if args.png and any(l["kind"] == "sweep" for l in lines):
        plot(lines, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
