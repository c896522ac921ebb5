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


def _client(address: str, request_bytes: bytes, max_new_tokens: int, prompts: int, threads: int, start_at: float,
            stop_at: float, results, measure_at: float | None = None) -> None:
    """`threads` clients calling Generate back to back from `start_at` until `stop_at`
    (time.time()); puts (latencies, errors, shed, when the last call ended) on `results`, of the
    calls that started at `measure_at` or later (the warm-up before it is not counted). Runs in
    the bench process or in a client process of its own."""
    measure_at = start_at if measure_at is None else measure_at
    channel = rpc.open_channel(address)
    stub = rollout_pb2_grpc.RolloutStub(channel)
    request = rollout_pb2.GenerateRequest.FromString(request_bytes)
    latencies: list[float] = []
    errors: list[str] = []
    shed = [0]
    lock = threading.Lock()

    def client() -> None:
        while time.time() < stop_at:
            t0 = time.perf_counter()
            counted = time.time() >= measure_at
            try:
                reply = stub.Generate(request, timeout=120)
            except grpc.RpcError as e:
                with lock:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        shed[0] += counted
                    else:
                        errors.append(f"{e.code().name}: {e.details()}")
                time.sleep(0.02)
                continue
            ok = len(reply.results) == prompts and all(len(r.output_ids) == max_new_tokens for r in reply.results)
            with lock:
                if counted:
                    latencies.append(time.perf_counter() - t0)
                if not ok:
                    errors.append("a reply with missing completions")

    workers = [threading.Thread(target=client) for _ in range(threads)]
    time.sleep(max(0.0, start_at - time.time()))
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    channel.close()
    results.put((latencies, errors, shed[0], time.time()))


def run(model_dir: Path, *, clients: int, seconds: float, max_new_tokens: int = 8, log_dir: Path | None = None,
        prompts: list[str] = PROMPTS, device: str = "cpu", max_batch_size: int = 0, load_weights: bool = True,
        dtype: str = "", processes: int = 1, warmup: float = 0.0, front_end: str = "inline") -> dict:
    """`clients` threads (spread over `processes` client processes: one Python process cannot
    make calls fast enough for a GPU) each calling Generate with `prompts` back to back for
    `warmup` seconds not counted (on a GPU the batch sizes and prefill shapes the load brings
    are captured as graphs then), then `seconds` counted, against one engine on `device`
    (`front_end` "process": the server's front end in a process of its own); the limit is one
    call of every client's prompts."""
    import multiprocessing
    import queue as queues

    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rlfleet-load-"))
    fleet = LocalFleet(log_dir, env={"OMP_NUM_THREADS": "1"})
    try:
        child = fleet.start("rollout", "rollout-0", ["--front-end", front_end])
        fleet.wait_ready()
        channel = rpc.open_channel(child.address)
        stub = rollout_pb2_grpc.RolloutStub(channel)
        stub.Configure(rollout_pb2.ConfigureRolloutRequest(config=rollout_pb2.RolloutConfig(
            model_path=str(model_dir), load_weights=load_weights, device=device, max_batch_size=max_batch_size,
            dtype=dtype)), timeout=300)
        sampling = rollout_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        request = rollout_pb2.GenerateRequest(prompts=prompts, sampling=sampling)
        stub.Generate(request, timeout=60)  # warm
        # the limit: one call holding every client's prompts (the second of two: the first warms its shapes)
        batched = rollout_pb2.GenerateRequest(prompts=list(prompts) * clients, sampling=sampling)
        stub.Generate(batched, timeout=300)
        started = time.perf_counter()
        stub.Generate(batched, timeout=300)
        limit = len(prompts) * clients / (time.perf_counter() - started)

        peak = [_rss_kib(child.process.pid)]
        start_rss = peak[0]
        processes = max(1, min(processes, clients))
        start_at = time.time() + (0.0 if processes == 1 else 5.0)  # (client processes start first)
        measure_at = start_at + warmup
        stop_at = measure_at + seconds
        shares = [clients // processes + (i < clients % processes) for i in range(processes)]
        args = (child.address, request.SerializeToString(), max_new_tokens, len(prompts))
        if processes == 1:
            results: queues.Queue = queues.Queue()
            workers = [threading.Thread(target=_client, args=(*args, clients, start_at, stop_at, results, measure_at))]
        else:
            context = multiprocessing.get_context("spawn")
            results = context.Queue()
            workers = [context.Process(target=_client, args=(*args, share, start_at, stop_at, results, measure_at))
                       for share in shares]
        for w in workers:
            w.start()
        parts = []
        loads = []  # the engine's counters when the counted window opens, and at the end
        while len(parts) < len(workers):
            try:
                parts.append(results.get(timeout=0.2))
            except queues.Empty:
                peak[0] = max(peak[0], _rss_kib(child.process.pid))
            if not loads and time.time() >= measure_at:
                loads.append(stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=30).load)
        loads.append(stub.GetStatus(rollout_pb2.GetRolloutStatusRequest(), timeout=30).load)
        elapsed = max(part[3] for part in parts) - measure_at
        for w in workers:
            w.join()
        channel.close()
    finally:
        fleet.stop()
    latencies = [x for part in parts for x in part[0]]
    errors = [x for part in parts for x in part[1]]
    shed = sum(part[2] for part in parts)
    calls = len(latencies)
    quantiles = statistics.quantiles(latencies, n=100) if calls >= 2 else [float("nan")] * 99
    throughput = calls * len(prompts) / elapsed
    rounds = loads[-1].rounds - loads[0].rounds
    steps = loads[-1].decode_steps - loads[0].decode_steps
    return {
        # how the engine's rounds were filled in the counted window: decode steps between host
        # looks, rows a step, prefill forwards a round
        "steps_per_round": round(steps / max(rounds, 1), 2),
        "rows_per_step": round((loads[-1].row_steps - loads[0].row_steps) / max(steps, 1), 1),
        "prefills_per_round": round((loads[-1].prefills - loads[0].prefills) / max(rounds, 1), 2),
        "preempted": loads[-1].preempted - loads[0].preempted,
        # where the engine's time went in the counted window (seconds of it)
        **{k: round(getattr(loads[-1], k) - getattr(loads[0], k), 3) for k in ("prefill_s", "decode_s", "host_s")},
        "bench": "load", "clients": clients, "client_processes": processes, "front_end": front_end, "prompts_per_call": len(prompts),
        "device": device, "seconds": round(elapsed, 2), "calls": calls, "shed": shed,
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
