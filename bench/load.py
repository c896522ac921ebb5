"""Many concurrent Generate calls against one rollout engine for a bounded time.

Each of `--clients` threads calls Generate back to back for `--seconds` (a call refused with
RESOURCE_EXHAUSTED is counted as shed and retried after a short back-off, as a well-behaved
client does). Reported: completions and tokens per second, latency percentiles, calls shed,
any error, and the engine process's peak memory. The limit measured in the same run is the same
engine's throughput on one call holding as many prompts as all clients together: `ratio` is how
much of it the concurrent clients get.

    python bench/load.py --clients 32 --seconds 20 --out run.jsonl && python bench/common.py publish load run.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import commit, emit, machine  # noqa: E402
from services import rpc  # noqa: E402
from services.api import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from services.launcher import LocalFleet  # noqa: E402

PROMPTS = ["1+2=", "13+29=", "7-5=", "40+2="]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run(model_dir: Path, *, clients: int, seconds: float, max_new_tokens: int = 8, log_dir: Path | None = None,
        prompts: list[str] = PROMPTS, device: str = "cpu", max_batch_size: int = 0) -> dict:
    """`clients` threads each calling Generate with `prompts` back to back for `seconds`, against
    one engine on `device`; the limit is one call of every client's prompts at once."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rlfleet-load-"))
    fleet = LocalFleet(log_dir, env={"OMP_NUM_THREADS": "1"})
    try:
        child = fleet.start("rollout", "rollout-0", [])
        fleet.wait_ready()
        channel = rpc.open_channel(child.address)
        stub = rollout_pb2_grpc.RolloutStub(channel)
        stub.Configure(rollout_pb2.ConfigureRolloutRequest(config=rollout_pb2.RolloutConfig(
            model_path=str(model_dir), load_weights=True, device=device, max_batch_size=max_batch_size)), timeout=300)
        sampling = rollout_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        request = rollout_pb2.GenerateRequest(prompts=prompts, sampling=sampling)
        stub.Generate(request, timeout=60)  # warm

        # the limit: one call holding every client's prompts
        batched = rollout_pb2.GenerateRequest(prompts=list(prompts) * clients, sampling=sampling)
        started = time.perf_counter()
        stub.Generate(batched, timeout=300)
        limit = len(prompts) * clients / (time.perf_counter() - started)

        latencies: list[float] = []
        errors: list[str] = []
        shed = [0]
        lock = threading.Lock()
        stop_at = time.monotonic() + seconds
        peak = [_rss_kib(child.process.pid)]
        start_rss = peak[0]

        def client() -> None:
            while time.monotonic() < stop_at:
                t0 = time.perf_counter()
                try:
                    reply = stub.Generate(request, timeout=60)
                except grpc.RpcError as e:
                    with lock:
                        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                            shed[0] += 1
                        else:
                            errors.append(f"{e.code().name}: {e.details()}")
                    time.sleep(0.02)
                    continue
                ok = len(reply.results) == len(prompts) and all(len(r.output_ids) == max_new_tokens for r in reply.results)
                with lock:
                    latencies.append(time.perf_counter() - t0)
                    if not ok:
                        errors.append("a reply with missing completions")

        threads = [threading.Thread(target=client) for _ in range(clients)]
        began = time.perf_counter()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak[0] = max(peak[0], _rss_kib(child.process.pid))
            time.sleep(0.2)
        elapsed = time.perf_counter() - began
        channel.close()
    finally:
        fleet.stop()
    calls = len(latencies)
    quantiles = statistics.quantiles(latencies, n=100) if calls >= 2 else [float("nan")] * 99
    throughput = calls * len(prompts) / elapsed
    return {
        "bench": "load", "clients": clients, "prompts_per_call": len(prompts), "device": device, "seconds": round(elapsed, 2), "calls": calls, "shed": shed[0],
        "errors": len(errors), "first_errors": errors[:3], "completions_per_s": round(throughput, 1),
        "tokens_per_s": round(throughput * max_new_tokens, 1), "limit_completions_per_s": round(limit, 1),
        "ratio": round(throughput / limit, 3), "p50_s": round(quantiles[49], 4), "p90_s": round(quantiles[89], 4),
        "p99_s": round(quantiles[98], 4), "rss_start_mb": round(start_rss / 1024, 1),
        "rss_peak_mb": round(peak[0] / 1024, 1), "date": time.strftime("%Y-%m-%d"), "commit": commit(),
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(__file__).resolve().parents[1] / "examples/arith/model")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    print(f"# {args.clients} clients for {args.seconds:.0f} s against one engine ...", file=sys.stderr, flush=True)
    emit(run(args.model, clients=args.clients, seconds=args.seconds), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
