"""What the rollout server's front end costs per call, apart from generating.

The rollout servicer (`services/rollout/server.py`: admission, metrics, prompt checks, reply
building) answers one-prompt Generate calls from an engine that returns at once, with
`--new-tokens` tokens each, for C clients in two client processes. The limit, measured in the
same run: a bare gRPC server of the same kind (thread pool, same channel options) whose handler
returns a prebuilt reply of the same size. Reported for each: calls/s, and the server process's
CPU seconds per call (its gRPC threads' share of the GIL the serving thread needs on a GPU host:
the engine serves ~1,300 one-prompt calls/s of 128 tokens at C = 256 on an H100).

With `--front-end process` a third server is measured: the same servicer behind a front end in
a process of its own (`services/rollout/frontend.py`), the calls forwarded over its link. The CPU
counted is still this process's, the engine's: what the front end leaves to the process that
runs the serving thread. The front end's own process is reported apart.

    python bench/frontend.py --out run.jsonl && python bench/common.py publish frontend run.jsonl
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
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

    def close(self) -> None:
        pass

    def submit(self, prompts_ids, sampling, cancelled=None, *, on_result=None, priority="train", on_finish=None):
        """Each completion to `on_result` at once, then the end to `on_finish`."""
        request = _Answered()
        for i, g in enumerate(self.generate(prompts_ids, sampling)[0]):
            on_result(i, g)
        on_finish(request)
        return request


class _Answered:
    error = None


class _Bare(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, reply: rollout_pb2.GenerateResponse):
        self.reply = reply

    def Generate(self, request, context):
        return self.reply


def _servicer_server() -> tuple[rpc.Server, int, str]:
    """The servicer's gRPC server, its port, and the path of its link socket (for a front end)."""
    import tempfile

    from services.rollout.link import Listener

    servicer = rollout_server.RolloutServicer()
    servicer._engine = InstantEngine()
    server = rollout_server.build_server(servicer=servicer)
    path = os.path.join(tempfile.mkdtemp(prefix="rlfleet-frontend-bench-"), "link.sock")
    server.on_stop.append(Listener(path, servicer, None).close)
    return server, server.port, path


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


def _front_end(engine_port: int, link_path: str, ports, stop) -> None:
    """A front end process in front of this bench's servicer (child process: spawn)."""
    from services.rollout import frontend, link

    channel = rpc.open_channel(f"127.0.0.1:{engine_port}")
    front = frontend.FrontEnd(link.EngineLink(link_path, None), channel)
    server = rpc.create_server(lambda s: s.add_generic_rpc_handlers((front,)), (rollout_server.SERVICE_NAME,),
                               max_workers=rollout_server.SERVER_THREADS)
    server.set_serving(True)
    ports.put((server.port, os.getpid()))
    stop.wait()
    server.grpc_server.stop(0)


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process `pid` so far (Linux)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(port: int, clients: int, new_tokens: int, seconds: float, also: int | None = None) -> tuple[float, ...]:
    """(calls/s, server CPU seconds per call[, process `also`'s CPU seconds per call]) over `seconds`
    of C clients in two processes."""
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
    also_before = _cpu_seconds(also) if also else 0.0
    parts = [results.get(timeout=seconds + 120) for _ in workers]
    after = max(part[3] for part in parts)
    used = resource.getrusage(resource.RUSAGE_SELF)
    also_used = _cpu_seconds(also) - also_before if also else 0.0
    for w in workers:
        w.join()
    errors = [e for part in parts for e in part[1]]
    if errors:
        raise RuntimeError(f"{len(errors)} calls failed, first: {errors[0]}")
    calls = sum(len(part[0]) for part in parts)
    cpu = used.ru_utime + used.ru_stime - before.ru_utime - before.ru_stime
    if also:
        return calls / (after - opened), cpu / max(calls, 1), also_used / max(calls, 1)
    return calls / (after - opened), cpu / max(calls, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--clients", default="64,256")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--front-end", choices=("inline", "process"), default="inline",
                        help="process: also the servicer behind a front end in a process of its own")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    servicer, servicer_port, link_path = _servicer_server()
    bare, bare_port = _bare_server(args.new_tokens)
    split = None
    if args.front_end == "process":
        context = multiprocessing.get_context("spawn")
        ports, stop = context.Queue(), context.Event()
        child = context.Process(target=_front_end, args=(servicer_port, link_path, ports, stop), daemon=True)
        child.start()
        split = ports.get(timeout=60)
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
            if split is not None:
                rate, cpu, front_cpu = measure(split[0], clients, args.new_tokens, args.seconds, also=split[1])
                line |= {"split_calls_per_s": round(rate, 1), "split_ratio": round(rate / limit, 3),
                         "split_engine_cpu_us_per_call": round(cpu * 1e6, 1),
                         "split_front_end_cpu_us_per_call": round(front_cpu * 1e6, 1)}
            emit(line, args.out)
            print(f"#   {line['calls_per_s']} calls/s ({line['ratio']} of bare gRPC's {line['limit_calls_per_s']}); "
                  f"server CPU {line['server_cpu_us_per_call']} us a call (bare: {line['limit_server_cpu_us_per_call']})",
                  file=sys.stderr, flush=True)
            if split is not None:
                print(f"#   front end in its own process: {line['split_calls_per_s']} calls/s; the engine's process "
                      f"{line['split_engine_cpu_us_per_call']} us a call, the front end's "
                      f"{line['split_front_end_cpu_us_per_call']} us", file=sys.stderr, flush=True)
    finally:
        if split is not None:
            stop.set()
            child.join(timeout=10)
        servicer.stop(0)
        bare.stop(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
