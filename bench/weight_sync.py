"""Weight-sync throughput of each data plane against its physical limit, measured in one run.

Starts a real trainer and rollout engine(s) as processes (as `rlfleet run` does), syncs a model of
--mb megabytes over every plane this machine offers, and measures beside it the limit the plane
is bounded by: a raw loopback TCP socket (grpc_stream), a plain memory copy (shm), a bare
gloo/NCCL broadcast of one flat tensor (broadcast; NCCL from GPU 0 to GPU 1), a device-to-device
copy (cuda_ipc) and a pinned host->device copy (syncs from the host store of an offloaded trainer). Each sync is timed
as the coordinator sees it (manifest, transfer, verification, load) after a train step, so every
sync packs new weights, and the limit is measured again right after each timed sync (medians of
both are compared). Prints one JSON line per plane; --out appends them to a file.

    python bench/weight_sync.py --json --mb 512 --out run.jsonl && python bench/common.py publish weight_sync run.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, median_seconds, record, two_ranks  # noqa: E402
from services.api import rollout_pb2, trainer_pb2  # noqa: E402
from services.coordinator.clients import RolloutClient, TrainerClient  # noqa: E402
from services.coordinator.weight_sync import WeightSyncer  # noqa: E402
from services.launcher import LocalFleet  # noqa: E402


def make_model(directory: Path, target_mb: int) -> int:
    from services.models import DecoderLM, ModelConfig, init_weights, make_char_tokenizer, save_hf_dir

    tokenizer = make_char_tokenizer("0123456789+-= ")
    hidden = 1024
    per_layer = 4 * hidden * hidden + 3 * hidden * 2816
    layers = max(1, int(target_mb * 1e6 / 4 / per_layer))
    config = ModelConfig(
        architecture="llama", vocab_size=tokenizer.vocab_size, hidden_size=hidden, intermediate_size=2816,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.device("meta"):
        model = DecoderLM(config)
    model = model.to_empty(device="cpu")
    init_weights(model, seed=0)
    save_hf_dir(model, config, directory)
    tokenizer.save(directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextlib.contextmanager
def trainer_and_engine(tmp: Path, log_level: str = "info", env: dict[str, str] | None = None
                       ) -> Iterator[tuple[LocalFleet, TrainerClient, RolloutClient]]:
    """A trainer and a rollout engine, each its own process, as `rlfleet run` starts them."""
    fleet = LocalFleet(tmp / "logs", env=env)
    try:
        fleet.start("trainer", "trainer-0", ["--log-level", log_level])
        fleet.start("rollout", "rollout-0", ["--log-level", log_level])
        fleet.wait_ready(timeout_s=300)
        yield fleet, TrainerClient(fleet.children[0].address), RolloutClient(fleet.children[1].address)
    finally:
        fleet.stop()


def configure(trainer: TrainerClient, engine: RolloutClient, model: Path, device: str, offload: bool,
              engine_device: str | None = None) -> None:
    trainer.configure(trainer_pb2.TrainerConfig(model_path=str(model), device=device, offload=offload,
                                                optimizer=trainer_pb2.OptimizerConfig(lr=1e-6)))
    engine.configure(rollout_pb2.RolloutConfig(model_path=str(model), device=engine_device or device))


def placement(device: str, plane: str) -> tuple[str, str]:
    """Trainer and engine devices for a plane: on GPUs the trainer takes GPU 0, and the engine
    shares it (cuda_ipc) or takes GPU 1 (broadcast, over NCCL)."""
    if device == "cpu":
        return "cpu", "cpu"
    return "cuda:0", "cuda:1" if plane == "broadcast" else "cuda:0"


def syncer_for(trainer: TrainerClient, engines: list[RolloutClient], plane: str, pool) -> WeightSyncer:
    return WeightSyncer(
        trainer=trainer, engines=engines, trainer_caps=trainer.capabilities,
        engine_caps=[e.capabilities for e in engines], forced=plane, exact=False, timeout_s=600.0, token="", pool=pool,
    )


# ---- limits -------------------------------------------------------------------------------------
def tcp_limit(nbytes: int) -> float:
    """A raw loopback socket: sendall of one buffer, recv_into a preallocated one."""
    payload = bytearray(nbytes)
    sink = bytearray(nbytes)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def receive():
        conn, _ = server.accept()
        with conn:
            view, got = memoryview(sink), 0
            while got < nbytes:
                got += conn.recv_into(view[got:], nbytes - got)

    def once():
        t = threading.Thread(target=receive)
        t.start()
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(payload)
        t.join()

    seconds = median_seconds(once)
    server.close()
    return nbytes / seconds / 1e9


def memcpy_limit(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    return nbytes / median_seconds(lambda: dst.copy_(src)) / 1e9


_GLOO_PEER = """
import datetime, os, sys, time, torch, torch.distributed as dist
rank, port, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
pg = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, 2, datetime.timedelta(seconds=60))
t = torch.ones(n, dtype=torch.uint8) if rank == 0 else torch.zeros(n, dtype=torch.uint8)
opts = dist.BroadcastOptions()
times = []
for i in range(4):
    pg.barrier().wait()
    s = time.perf_counter(); pg.broadcast([t], opts).wait(); times.append(time.perf_counter() - s)
if rank == 0:
    print(sorted(times[1:])[1], flush=True)
pg.barrier().wait()
os._exit(0)  # gloo's destructor aborts at interpreter exit
"""


def gloo_limit(nbytes: int) -> float:
    out = two_ranks(lambda rank, port: [sys.executable, "-c", _GLOO_PEER, str(rank), str(port), str(nbytes)])
    return nbytes / float(out.strip()) / 1e9


_NCCL_PEER = """
import datetime, os, sys, time, torch, torch.distributed as dist
rank, port, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.cuda.set_device(rank)
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
pg = dist.ProcessGroupNCCL(dist.PrefixStore("bench", store), rank, 2, dist.ProcessGroupNCCL.Options())
t = torch.ones(n, dtype=torch.uint8, device="cuda") if rank == 0 else torch.zeros(n, dtype=torch.uint8, device="cuda")
opts = dist.BroadcastOptions()
times = []
for i in range(6):
    pg.barrier().wait(); torch.cuda.synchronize()
    s = time.perf_counter(); pg.broadcast([t], opts).wait(); torch.cuda.synchronize(); times.append(time.perf_counter() - s)
assert rank == 0 or bool((t == 1).all())
if rank == 0:
    print(sorted(times[1:])[2], flush=True)
pg.barrier().wait(); torch.cuda.synchronize()
os._exit(0)
"""


def nccl_limit(nbytes: int) -> float:
    """A bare NCCL broadcast of one flat tensor from GPU 0 to GPU 1, one process each (as the
    trainer and the engine are): the median of five after a warm-up."""
    out = two_ranks(lambda rank, port: [sys.executable, "-c", _NCCL_PEER, str(rank), str(port), str(nbytes)])
    return nbytes / float(out.split()[-1]) / 1e9  # NCCL may print its version first


# ---- planes -------------------------------------------------------------------------------------
def d2d_limit(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")

    def once():
        dst.copy_(src)
        torch.cuda.synchronize()

    return nbytes / median_seconds(once) / 1e9


def h2d_limit(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")

    def once():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return nbytes / median_seconds(once) / 1e9


# Not timed: the first sync builds groups, and the first two fill both buffer sets that syncs
# then use in turn (shm segment sets, an engine's staging), each paying its page faults once.
WARMUP_SYNCS = 2


def time_plane(trainer, engines, plane: str, repeats: int, pool, *, sleep: bool = False,
               limit: Callable[[], float]) -> tuple[float, float]:
    """Median seconds per sync, and the median of `limit()` (GB/s) measured right after each
    timed sync: on a shared machine the limit drifts, and a ratio should compare like with like."""
    syncer = syncer_for(trainer, engines, plane, pool)
    sample = trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5], advantage=1.0)
    times, limits = [], []
    try:
        for i in range(repeats + WARMUP_SYNCS):
            trainer.train_step(trainer_pb2.Batch(samples=[sample]))  # new weights: every sync packs afresh
            if sleep:  # an offloaded trainer: the sync reads its host store
                trainer.sleep()
            start = time.perf_counter()
            result = syncer.sync(set(range(len(engines))))
            elapsed = time.perf_counter() - start
            if result.failures:
                raise RuntimeError(f"{plane} sync failed: {result.failures}")
            if i >= WARMUP_SYNCS:
                times.append(elapsed)
                limits.append(limit())
                print(f"  {plane} sync {i}: {elapsed:.3f}s (limit now {limits[-1]:.2f} GB/s)", file=sys.stderr, flush=True)
            else:
                print(f"  {plane} sync {i}: {elapsed:.3f}s (warm-up, not timed)", file=sys.stderr, flush=True)
    finally:
        syncer.close()
    return statistics.median(times), statistics.median(limits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="model size in MB (fp32)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--planes", default=None, help="default: grpc_stream,shm,broadcast on CPU; "
                        "cuda_ipc,cuda_ipc_host with --device cuda, and broadcast,broadcast_host too "
                        "where there are two GPUs")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: the trainer on GPU 0, the engine beside it "
                        "for cuda_ipc and on GPU 1 for broadcast (NCCL)")
    parser.add_argument("--json", action="store_true", help="JSON lines only on stdout (progress on stderr)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    num_gpus = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        model_bytes = make_model(Path(tmp) / "model", args.mb)
        print(f"model: {model_bytes / 1e6:.0f} MB", file=sys.stderr, flush=True)
        pool = ThreadPoolExecutor(8)
        with trainer_and_engine(Path(tmp)) as (_, trainer, engine):
            on_gpu = args.device == "cuda"
            limits = {
                "grpc_stream": ("tcp_loopback", lambda: tcp_limit(model_bytes)),
                "shm": ("memcpy", lambda: memcpy_limit(model_bytes)),
                "broadcast": ("nccl_broadcast", lambda: nccl_limit(model_bytes)) if on_gpu
                else ("gloo_broadcast", lambda: gloo_limit(model_bytes)),
                "broadcast_host": ("pinned_h2d", lambda: h2d_limit(model_bytes)),
                "cuda_ipc": ("d2d_copy", lambda: d2d_limit(model_bytes)),
                "cuda_ipc_host": ("pinned_h2d", lambda: h2d_limit(model_bytes)),
            }
            default = "grpc_stream,shm,broadcast"
            if on_gpu:
                default = "cuda_ipc,cuda_ipc_host" + (",broadcast,broadcast_host" if num_gpus >= 2 else "")
            for name in (args.planes or default).split(","):
                from_host = name.endswith("_host")
                plane = name.removesuffix("_host")
                device, engine_device = placement(args.device, plane)
                configure(trainer, engine, Path(tmp) / "model", device, offload=from_host, engine_device=engine_device)
                limit_name, measure = limits[name]
                seconds, limit = time_plane(trainer, [engine], plane, args.repeats, pool, sleep=from_host, limit=measure)
                line = record(name, model_bytes / seconds / 1e9, limit, plane=plane, source="host" if from_host else "live",
                              bytes=model_bytes, limit=limit_name, seconds=round(seconds, 4), num_gpus=num_gpus,
                              trainer_device=device, engine_device=engine_device)
                emit(line, args.out)
        pool.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
