"""What the prefix cache saves on a multi-turn workload: second-turn prefill, cache on against off.

64 conversations (by default), each a ~1k-token history of its own (turn 1) answered with
`--reply` tokens; turn 2 is the history, the reply and `--turn` new tokens. Both engines (one
with `prefix_cache` on, one off, same weights) run turn 1, then turn 2 with max_new_tokens=1, so
that the call is its prefill (and one sampled token). Reported per repeat (a new set of
conversations each): the second-turn call's seconds on and off, their ratio, the cache's hit
rate over turn 2's prompt tokens, and the ratio's floor: the share of prompt tokens a cache hit
still leaves to compute (1 - hit rate; attention over the cached history is extra work on top).
Turn 1's prompt and reply are cached as its rows finish, so the hit runs to the reply's last
full block. A PNG draws the two times per repeat.

    python bench/prefix.py --out run.jsonl --png bench/results/prefix-cpu.png && python bench/common.py publish prefix run.jsonl
    python bench/prefix.py --device cuda --shape 0.5b   # a GPU: Qwen2.5-0.5B's shape, bf16
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import commit, emit, machine  # noqa: E402
from bench.serve import shaped_model  # noqa: E402


def conversations(count: int, history: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(history + rng.randrange(-16, 17))] for _ in range(count)]


def second_turn(engine, firsts: list[list[int]], reply: int, turn: int, seed: int) -> tuple[float, list]:
    """Turn 1 (replies of `reply` tokens), then the timed turn 2: (seconds, turn-2 results)."""
    from services.rollout.types import Sampling

    answers, _ = engine.generate(firsts, Sampling(temperature=0.0, max_new_tokens=reply, ignore_eos=True))
    rng = random.Random(seed + 1)
    vocab = engine.model_config.vocab_size
    seconds = [first + a.output_ids + [rng.randrange(3, vocab) for _ in range(turn)] for first, a in zip(firsts, answers)]
    started = time.perf_counter()
    results, _ = engine.generate(seconds, Sampling(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    took = time.perf_counter() - started
    engine.load()  # (waits for the round that handed the results back: its counters are in)
    return took, results


def profiled(engine, firsts: list[list[int]], args, path: Path) -> None:
    """One more second turn with the cache on under torch.profiler: the tables to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from services.rollout.types import Sampling

    answers, _ = engine.generate(firsts, Sampling(temperature=0.0, max_new_tokens=args.reply, ignore_eos=True))
    seconds = [first + a.output_ids + first[: args.turn] for first, a in zip(firsts, answers)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        # (on this thread, which the profiler records: the engine's serving thread has no work)
        engine.core.generate(seconds, Sampling(temperature=0.0, max_new_tokens=1, ignore_eos=True))
        took = time.perf_counter() - started
    events = prof.key_averages()
    tables = [f"# second turn, cache on, profiled: {took:.4f} s", events.table(sort_by="self_cpu_time_total", row_limit=25)]
    if torch.cuda.is_available():
        tables.append(events.table(sort_by="self_device_time_total", row_limit=25))
    path.write_text("\n".join(tables))
    print(f"# profiled second turn {took:.4f} s: tables in {path}", file=sys.stderr, flush=True)


def plot(lines: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    repeats = [line["repeat"] for line in lines]
    ax.bar([r - 0.2 for r in repeats], [line["off_s"] for line in lines], width=0.4, label="cache off")
    ax.bar([r + 0.2 for r in repeats], [line["on_s"] for line in lines], width=0.4, label="cache on")
    ax.set_xticks(repeats)
    ax.set(xlabel="repeat (new conversations)", ylabel="second-turn prefill call (s)")
    ax.legend(fontsize=8)
    first = lines[0]
    fig.suptitle(f"prefix cache: {first['conversations']} conversations, ~{first['history']}-token history "
                 f"({first['device']})\nratio {statistics.median(line['ratio'] for line in lines):.3f}, hit rate "
                 f"{first['hit_rate']:.3f}; {first['machine']}, {first['commit']}, {first['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shape", choices=("0.5b", "1.5b", "tiny"), default="tiny",
                        help="bench/rollout.py's shapes, random weights (bfloat16 on a GPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--history", type=int, default=1000, help="turn 1's prompt tokens (+-16)")
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--turn", type=int, default=32, help="new tokens of turn 2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--profile", type=Path,
                        help="after the repeats, profile one more second turn with the cache on (torch.profiler: "
                             "its top kernels and host ops) and write the tables here")
    args = parser.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"prefix: --device {args.device} needs a CUDA GPU", file=sys.stderr)
        return 2
    from services.rollout.engine import RolloutEngine, RolloutSettings

    model = shaped_model(args.shape, Path(tempfile.mkdtemp(prefix="rlfleet-prefix-")) / args.shape)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"

    def engine(prefix_cache: bool) -> RolloutEngine:
        return RolloutEngine(RolloutSettings(model_path=str(model), device=args.device, dtype=dtype, seed=7,
                                             load_weights=False, max_batch_size=args.conversations,
                                             prefix_cache=prefix_cache))

    on, off = engine(True), engine(False)
    lines = []
    try:
        vocab = on.model_config.vocab_size
        warm = conversations(args.conversations, args.history, 10_000, vocab)
        for e in (on, off):  # the pool made, the kernels and shapes seen once
            second_turn(e, warm, args.reply, args.turn, 10_000)
        for repeat in range(args.repeats):
            print(f"# [{repeat + 1}/{args.repeats}] {args.conversations} conversations ...", file=sys.stderr,
                  flush=True)
            firsts = conversations(args.conversations, args.history, repeat, vocab)
            prefix = on.core.scheduler.prefix
            hit = prefix.hit_tokens
            on_s, on_results = second_turn(on, firsts, args.reply, args.turn, repeat)
            stats = on.core.scheduler.last_stats  # the second turn's busy period, with the cache on
            # turn 2's own share of the counts (turn 1 looked up too, and found nothing)
            hit_rate = (prefix.hit_tokens - hit) / max(1, sum(len(g.prompt_ids) for g in on_results))
            off_s, off_results = second_turn(off, firsts, args.reply, args.turn, repeat)
            same = sum(a.output_ids == b.output_ids for a, b in zip(on_results, off_results))
            line = {"bench": "prefix", "repeat": repeat, "device": args.device, "shape": args.shape, "dtype": dtype,
                    "conversations": args.conversations, "history": args.history, "reply": args.reply,
                    "turn": args.turn, "on_s": round(on_s, 4), "off_s": round(off_s, 4),
                    "ratio": round(on_s / off_s, 4), "hit_rate": round(hit_rate, 4),
                    "floor": round(1 - hit_rate, 4), "same_tokens": f"{same}/{len(on_results)}",
                    "on_prefill_s": round(stats.prefill_s, 4), "on_decode_s": round(stats.decode_s, 4),
                    "on_host_s": round(stats.host_s, 4),
                    "date": time.strftime("%Y-%m-%d"),
                    "commit": commit(), "machine": machine()}
            emit(line, args.out)
            lines.append(line)
            print(f"#   on {on_s:.3f} s, off {off_s:.3f} s: ratio {line['ratio']} (floor {line['floor']}), "
                  f"hit rate {line['hit_rate']}, same tokens {line['same_tokens']}; on: prefill {line['on_prefill_s']} s, "
                  f"decode {line['on_decode_s']} s, host {line['on_host_s']} s", file=sys.stderr, flush=True)
        if args.profile:
            profiled(on, conversations(args.conversations, args.history, 99, vocab), args, args.profile)
    finally:
        on.close()
        off.close()
    if args.png:
        plot(lines, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
