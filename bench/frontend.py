"""What the rollout server's front end costs per call, apart from generating.

The rollout servicer (`services/rollout/server.py`: admission, metrics, prompt checks, reply
building) answers one-prompt Generate calls from an engine that returns at once, with
`--new-tokens` tokens each, for C clients in two client processes. The limit, measured in the
same run: a bare gRPC server of the same kind (thread pool, same channel options) whose handler
returns a prebuilt reply of the same size. Reported for each: calls/s, and the server process's
CPU seconds per call (its gRPC threads' share of the GIL the serving thread needs on a GPU host:
the engine serves ~1,300 one-prompt calls/s of 128 tokens at C = 256 on an H100).

    python bench/frontend.py --out run.jsonl && python bench/common.py publish frontend run.jsonl
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import sys
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import commit, emit, machine  # noqa: E402
from bench.load import _client  # noqa: E402
from services import rpc  # noqa: E402
from services.api import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from services.rollout import server as rollout_server  # noqa: E402
from services.rollout.types import Generation  # noqa: E402

PROMPT_IDS = [3, 4, 5, 6, 7, 8]


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return list(PROMPT_IDS)


class InstantEngine:
    """An engine that answers every call at once with `n` tokens a prompt."""

    device = torch.device("cpu")
    tokenizer = _Tokenizer()
    max_positions = 1 << 16
    streams = True
    weight_version = 0

    def generate(self, prompts_ids, sampling, cancelled=None, *, priority="train", on_result=None):
        n = sampling.max_new_tokens
        return [Generation(prompt_index=i, prompt_ids=list(p), output_ids=list(range(n)), text="x" * n,
                           logprobs=[-0.5] * n, finish_reason="length", versions=((0, n),))
                for i, p in enumerate(prompts_ids)], 0


class _Bare(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, reply: rollout_pb2.GenerateResponse):
        self.reply = reply

    def Generate(self, request, context):
        return self.reply


def _servicer_server() -> tuple[rpc.Server, int]:
    servicer = rollout_server.RolloutServicer()
    servicer._engine = InstantEngine()
    server = rollout_server.build_server(servicer=servicer)
    return server, server.port


def _bare_server(new_tokens: int) -> tuple[grpc.Server, int]:
    g = InstantEngine().generate([PROMPT_IDS], rollout_server.sampling_from_proto(
        rollout_pb2.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)))[0][0]
    reply = rollout_pb2.GenerateResponse(weight_version=0, results=[rollout_server._completion(g, 0, True)])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=rollout_server.SERVER_THREADS),
                         options=rpc._CHANNEL_OPTIONS)
    rollout_pb2_grpc.add_RolloutServicer_to_server(_Bare(reply), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def measure(port: int, clients: int, new_tokens: int, seconds: float) -> tuple[float, float]:
    """(calls/s, server CPU seconds per call) over `seconds` of C clients in two processes."""
    request = rollout_pb2.GenerateRequest(prompts=["13+29="], sampling=rollout_pb2.SamplingParams(
        max_new_tokens=new_tokens, ignore_eos=True), return_logprobs=True)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.time() + 4.0  # (the client processes start first)
    measure_at, stop_at = start_at + 1.0, start_at + 1.0 + seconds
    shares = [clients // 2 + clients % 2, clients // 2]
    workers = [context.Process(target=_client, args=(f"127.0.0.1:{port}", request.SerializeToString(), new_tokens, 1,
                                                     share, start_at, stop_at, results, measure_at))
               for share in shares if share]
    for w in workers:
        w.start()
    time.sleep(max(0.0, measure_at - time.time()))
    before, opened = resource.getrusage(resource.RUSAGE_SELF), time.time()
    parts = [results.get(timeout=seconds + 120) for _ in workers]
    after = max(part[3] for part in parts)
    used = resource.getrusage(resource.RUSAGE_SELF)
    for w in workers:
        w.join()
    errors = [e for part in parts for e in part[1]]
    if errors:
        raise RuntimeError(f"{len(errors)} calls failed, first: {errors[0]}")
    calls = sum(len(part[0]) for part in parts)
    cpu = used.ru_utime + used.ru_stime - before.ru_utime - before.ru_stime
    return calls / (after - opened), cpu / max(calls, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--clients", default="64,256")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    servicer, servicer_port = _servicer_server()
    bare, bare_port = _bare_server(args.new_tokens)
    try:
        for i, clients in enumerate(counts):
            print(f"# [{i + 1}/{len(counts)}] {clients} clients, bare gRPC then the rollout servicer ...",
                  file=sys.stderr, flush=True)
            limit, limit_cpu = measure(bare_port, clients, args.new_tokens, args.seconds)
            rate, cpu = measure(servicer_port, clients, args.new_tokens, args.seconds)
            line = {"bench": "frontend", "clients": clients, "new_tokens": args.new_tokens,
                    "calls_per_s": round(rate, 1), "server_cpu_us_per_call": round(cpu * 1e6, 1),
                    "limit_calls_per_s": round(limit, 1), "limit_server_cpu_us_per_call": round(limit_cpu * 1e6, 1),
                    "ratio": round(rate / limit, 3), "date": time.strftime("%Y-%m-%d"), "commit": commit(),
                    "machine": machine()}
            emit(line, args.out)
            print(f"#   {line['calls_per_s']} calls/s ({line['ratio']} of bare gRPC's {line['limit_calls_per_s']}); "
                  f"server CPU {line['server_cpu_us_per_call']} us a call (bare: {line['limit_server_cpu_us_per_call']})",
                  file=sys.stderr, flush=True)
    finally:
        servicer.grpc_server.stop(0)
        bare.stop(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
