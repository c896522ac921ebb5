"""How well one rollout engine serves many concurrent one-prompt requests.

For each client count C (1, 8, 64, 256 by default): a rollout server (a real process, over gRPC
on loopback), C client threads each sending one-prompt Generate calls back to back for
`--seconds`. Reported: aggregate tokens/s as a ratio to one batched call of C prompts in the same
run (the same rows, what the engine does when it gets them together), p50 and p99 latency, calls
shed. A serving engine keeps the ratio near 1 as C grows; one that serves a call at a time falls
towards 1/C of its batched throughput. A PNG draws ratio and latency against C.

    python bench/serve.py --out run.jsonl --png bench/results/serve-<machine>.png && python bench/common.py publish serve run.jsonl
    python bench/serve.py --device cuda --shape 0.5b --new-tokens 128 --processes 8   # a GPU: Qwen2.5-0.5B's shape
    python bench/serve.py --device cuda --shape 0.5b --new-tokens 128 --in-process --profile-serving prof/

`--front-end process` serves the calls from a process of their own in front of the engine's
(`rlfleet serve rollout --front-end process`); `--front-end inline,process` runs each C with
both, one after the other, and draws one curve for each.

`--in-process` runs the engine in the bench process and its C clients as threads calling
`generate` directly: no gRPC, no server threads. Its ratio against the gRPC one's says how much of
what is lost is the front end's (request and reply handling beside the serving thread) and how
much the scheduler's own. `--profile-serving DIR` (with `--in-process`) writes a cProfile of the
serving thread for each C, and the share of its wall time it had the CPU; `--trace DIR` a short
torch.profiler timeline of each C (Chrome trace) and the share of it the device was busy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit  # noqa: E402
from bench.load import run  # noqa: E402

PROMPT = ["13+29="]
ARITH_MODEL = Path(__file__).resolve().parents[1] / "examples/arith/model"


def shaped_model(shape: str, directory: Path) -> Path:
    """A model directory of one of bench/rollout.py's shapes (its config and the arithmetic
    model's tokenizer, no weights: the engine initialises them), for `load_weights` off."""
    import json
    import shutil

    from bench.rollout import SHAPES, VOCAB
    from services.models import ModelConfig

    config = ModelConfig(architecture="qwen2", vocab_size=VOCAB, tie_word_embeddings=True,
                         max_position_embeddings=4096, **SHAPES[shape])
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict()))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ARITH_MODEL / name, directory / name)
    return directory


def device_timeline(path: Path, seconds: float) -> float:
    """torch.profiler over every thread and the GPU for `seconds`, its Chrome trace written to
    `path`; returns the share of that time some kernel or copy ran on the device."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        time.sleep(seconds)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    spans = sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA)
    if not spans:
        return 0.0
    busy, (start, end) = 0, spans[0]
    first = start
    for a, b in spans[1:]:
        if a > end:
            busy, start, end = busy + end - start, a, b
        else:
            end = max(end, b)
    busy += end - start
    return round(busy / max(end - first, 1), 3)


def run_in_process(model: Path, *, clients: int, seconds: float, max_new_tokens: int, device: str,
                   max_batch_size: int, warmup: float, load_weights: bool = True, dtype: str = "float32",
                   profile: Path | None = None, trace: Path | None = None) -> dict:
    """bench/load.py's measurement without gRPC: one engine in this process, `clients` threads
    calling `generate` with one prompt back to back; the limit is one call of `clients` prompts."""
    import statistics
    import threading
    import time

    from bench.common import commit, machine
    from services.rollout.engine import RolloutEngine, RolloutSettings
    from services.rollout.types import Sampling

    engine = RolloutEngine(RolloutSettings(model_path=str(model), device=device, dtype=dtype,
                                           max_batch_size=max_batch_size, load_weights=load_weights))
    prompt = [engine.tokenizer.encode(p) for p in PROMPT]
    sampling = Sampling(max_new_tokens=max_new_tokens, ignore_eos=True)
    engine.generate(prompt, sampling)
    engine.generate(prompt * clients, sampling)
    started = time.perf_counter()
    engine.generate(prompt * clients, sampling)
    limit = clients / (time.perf_counter() - started)
    profiler, cpu = None, {}
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        engine.close()  # a fresh engine whose serving thread starts under the profiler
        engine = RolloutEngine(RolloutSettings(model_path=str(model), device=device, dtype=dtype,
                                               max_batch_size=max_batch_size, load_weights=load_weights))
        serve = engine._serve

        def profiled() -> None:  # the serving thread, under the profiler, its CPU time kept
            started_wall, started_cpu = time.perf_counter(), time.thread_time()
            profiler.enable()
            try:
                serve()
            finally:
                profiler.disable()
                cpu.update(wall=time.perf_counter() - started_wall, cpu=time.thread_time() - started_cpu)

        engine._serve = profiled
        engine.generate(prompt * clients, sampling)
    measure_at = time.perf_counter() + warmup
    stop_at = measure_at + seconds
    latencies: list[float] = []
    lock = threading.Lock()

    def client() -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            results, _ = engine.generate(prompt, sampling)
            assert len(results[0].output_ids) == max_new_tokens
            if t0 >= measure_at:
                with lock:
                    latencies.append(time.perf_counter() - t0)

    workers = [threading.Thread(target=client) for _ in range(clients)]
    for w in workers:
        w.start()
    time.sleep(max(0.0, measure_at - time.perf_counter()))
    first = engine.load()
    timeline = None
    if trace is not None:  # a short device timeline from the middle of the counted window
        time.sleep(seconds / 2)
        timeline = device_timeline(trace / f"serve-c{clients}.json", 0.3)
    for w in workers:
        w.join()
    last = engine.load()
    elapsed = time.perf_counter() - measure_at
    engine.close()
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
    steps = last.decode_steps - first.decode_steps
    line = {
        "steps_per_round": round(steps / max(last.rounds - first.rounds, 1), 2),
        "rows_per_step": round((last.row_steps - first.row_steps) / max(steps, 1), 1),
        "prefills_per_round": round((last.prefills - first.prefills) / max(last.rounds - first.rounds, 1), 2),
        "preempted": last.preempted - first.preempted, "shed": 0, "errors": 0, "client_processes": 0,
        **{k: round(getattr(last, k) - getattr(first, k), 3) for k in ("prefill_s", "decode_s", "host_s")},
        "clients": clients, "in_process": True, "device": device, "seconds": round(elapsed, 2),
        "calls": len(latencies), "completions_per_s": round(len(latencies) / elapsed, 1),
        "tokens_per_s": round(len(latencies) / elapsed * max_new_tokens, 1), "limit_completions_per_s": round(limit, 1),
        "ratio": round(len(latencies) / elapsed / limit, 3), "p50_s": round(quantiles[49], 4),
        "p99_s": round(quantiles[98], 4), "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine(),
    }
    if timeline is not None:
        line["device_busy_frac"] = timeline
    if profiler is not None:
        import io
        import pstats

        line["serving_cpu_share"] = round(cpu["cpu"] / max(cpu["wall"], 1e-9), 3)
        profile.mkdir(parents=True, exist_ok=True)
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
        (profile / f"serving-c{clients}.txt").write_text(f"serving thread: cpu {cpu['cpu']:.2f} s of {cpu['wall']:.2f} s wall\n"
                                                       + text.getvalue())
    return line


def plot(lines: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    series: dict[str, list[dict]] = {}
    for line in lines:  # one curve per front end
        series.setdefault("in-process" if line.get("in_process") else line.get("front_end", "inline"), []).append(line)
    for i, (front_end, group) in enumerate(series.items()):
        clients = [line["clients"] for line in group]
        left.plot(clients, [line["ratio"] for line in group], "o-", color=f"C{i}", label=f"front end {front_end}")
        right.plot(clients, [line["p50_s"] for line in group], "o-", color=f"C{i}", label=f"p50, {front_end}")
        right.plot(clients, [line["p99_s"] for line in group], "s--", color=f"C{i}", label=f"p99, {front_end}")
    clients = sorted({line["clients"] for line in lines})
    left.plot(clients, [1 / c for c in clients], ":", color="grey", label="one call at a time (1/C)")
    left.axhline(0.8, color="green", linestyle="--", linewidth=0.8, label="goal 0.8")
    left.set(xscale="log", xlabel="concurrent clients C", ylabel="tokens/s over one batched call", ylim=(0, 1.1))
    left.legend(fontsize=7)
    right.set(xscale="log", yscale="log", xlabel="concurrent clients C", ylabel="latency of a call (s)")
    right.legend(fontsize=7)
    fig.suptitle(f"one engine serving C one-prompt clients ({lines[0]['device']}, {lines[0]['max_new_tokens']} new "
                 f"tokens)\n{lines[0]['machine']}, {lines[0]['commit']}, {lines[0]['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", type=Path, default=ARITH_MODEL)
    parser.add_argument("--shape", choices=("0.5b", "1.5b", "tiny"),
                        help="instead of --model: that shape with random weights (bfloat16 on a GPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--processes", type=int, default=1, help="client processes the clients are spread over")
    parser.add_argument("--clients", default="1,8,64,256")
    parser.add_argument("--seconds", type=float, default=10.0, help="per client count, counted")
    parser.add_argument("--warmup", type=float, default=2.0,
                        help="seconds of the same load before counting (graphs for its shapes captured)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--front-end", default="inline",
                        help="the server's front end: inline (in the engine's process), process (a process of its "
                             "own), or both, comma-separated (each C run with each, one after the other)")
    parser.add_argument("--in-process", action="store_true", help="no gRPC: the engine and its clients in this process")
    parser.add_argument("--profile-serving", type=Path, metavar="DIR", help="with --in-process: cProfile the serving thread")
    parser.add_argument("--trace", type=Path, metavar="DIR",
                        help="with --in-process on a GPU: a 0.3 s torch.profiler trace of each C, and the device's busy share")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(f"serve: --device {args.device} needs a CUDA GPU", file=sys.stderr)
            return 2
    model, options = args.model, {}
    if args.shape:
        import tempfile

        model = shaped_model(args.shape, Path(tempfile.mkdtemp(prefix="rlfleet-serve-")) / args.shape)
        options = {"load_weights": False, "dtype": "bfloat16" if args.device.startswith("cuda") else "float32"}
    front_ends = ["in-process"] if args.in_process else args.front_end.split(",")
    if any(f not in ("inline", "process", "in-process") for f in front_ends):
        print(f"serve: --front-end must be inline, process or both, got {args.front_end}", file=sys.stderr)
        return 2
    runs = [(clients, front_end) for clients in counts for front_end in front_ends]
    lines = []
    for i, (clients, front_end) in enumerate(runs):
        print(f"# [{i + 1}/{len(runs)}] {clients} clients for {args.seconds:.0f} s, front end {front_end} ...",
              file=sys.stderr, flush=True)
        if args.in_process:
            line = run_in_process(model, clients=clients, seconds=args.seconds, max_new_tokens=args.new_tokens,
                                  device=args.device, max_batch_size=max(counts), warmup=args.warmup,
                                  profile=args.profile_serving, trace=args.trace, **options)
        else:
            line = run(model, clients=clients, seconds=args.seconds, max_new_tokens=args.new_tokens, prompts=PROMPT,
                       device=args.device, max_batch_size=max(counts), processes=args.processes, warmup=args.warmup,
                       front_end=front_end, **options)
        line = {**line, "bench": "serve", "max_new_tokens": args.new_tokens, "model": args.shape or model.name,
                "warmup_s": args.warmup}
        emit(line, args.out)
        lines.append(line)
        print(f"#   ratio {line['ratio']}, p50 {line['p50_s']} s, p99 {line['p99_s']} s, {line['shed']} shed, "
              f"{line['errors']} errors; {line['rows_per_step']} rows a step, {line['steps_per_round']} steps and "
              f"{line['prefills_per_round']} prefills a round; prefill {line['prefill_s']} s, decode {line['decode_s']} s, "
              f"host {line['host_s']} s", file=sys.stderr, flush=True)
    if args.png:
        plot(lines, args.png)
    return 1 if any(line["errors"] for line in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
