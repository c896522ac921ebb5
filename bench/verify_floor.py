"""How close a verified sync can get to each plane's limit on this machine: the floor, measured.

A verified sync moves the bytes once and reads them at least twice more: the trainer fingerprints
what it sends, the engine what it receives (engines verify every sync; see docs/weight-sync.md).
This benchmark times the transfer alone (the plane's physical limit, as bench/weight_sync.py
measures it) and the transfer with both fingerprints done the fastest way the code can do them,
with no RPC, no manifest and no model. `floor_ratio` is therefore an upper bound on the `ratio`
bench/weight_sync.py can report for that plane here; `goal` is the issue's target for it.

    python bench/verify_floor.py --json                 # shm and gloo broadcast, on CPU
    python bench/verify_floor.py --json --device cuda   # cuda_ipc (live) and the host-copy upload

- shm: the trainer copies into a segment while hashing (copy-and-hash), then the engine hashes
  the segment. Also timed pipelined, each 16 MiB piece re-hashed as soon as it is written (from
  cache, a protocol the planes do not have): the floor is the faster of the two.
- broadcast (gloo): two processes. The trainer hashes then broadcasts while the engine hashes the
  parts that have arrived, as syncs do; and the trainer hashing while it sends. The faster counts.
- cuda_ipc: the trainer's fingerprint pass, then the engine's copy that fingerprints as it copies.
  Two processes' kernels take turns on one GPU (no MPS), so one process timing both in sequence
  is the floor.
- cuda_ipc_host: the trainer's fingerprints of its host copy are made at Sleep, so the floor is
  the engine's upload by the SMs, fingerprinting as it copies, against a pinned host->device copy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import emit, median_seconds, record, two_ranks  # noqa: E402

GOALS = {"shm": 0.7, "broadcast": 0.85, "cuda_ipc": 0.5, "cuda_ipc_host": 0.85}


def _line(plane: str, nbytes: int, limit_name: str, limit_s: float, floor_s: float, **extra) -> dict:
    line = record(f"verify_floor_{plane}", nbytes / floor_s / 1e9, nbytes / limit_s / 1e9, plane=plane, bytes=nbytes,
                  limit=limit_name, limit_seconds=round(limit_s, 5), floor_seconds=round(floor_s, 5),
                  goal=GOALS[plane], num_gpus=torch.cuda.device_count(), **extra)
    line["floor_ratio"] = line.pop("ratio")
    return line


def _alternating(limit, floor, repeats: int) -> tuple[float, float]:
    """Medians of `limit` and `floor` timed in turn, so that both see the same machine."""
    limit(), floor()  # warm-up: page faults, kernels compiled
    limits, floors = [], []
    for _ in range(repeats):
        for fn, out in ((limit, limits), (floor, floors)):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(limits), statistics.median(floors)


# ---- CPU ----------------------------------------------------------------------------------------
def shm_floor(nbytes: int, repeats: int) -> dict:
    import ctypes

    import xxhash

    from services.weights.fingerprint import PIECE_BYTES, _hash_pool, copy_and_fingerprint, fingerprint, host_bytes

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.ones(nbytes, dtype=torch.uint8)
    source, written = host_bytes(src), host_bytes(dst)

    def sequential():
        expected = copy_and_fingerprint(dst, src)
        if fingerprint(dst, "xxh3") != expected:
            raise AssertionError("shm floor: the copy does not verify")

    def piece(k: int) -> None:
        start, stop = k * PIECE_BYTES, min((k + 1) * PIECE_BYTES, nbytes)
        ctypes.memmove(dst.data_ptr() + start, src.data_ptr() + start, stop - start)
        xxhash.xxh3_64_intdigest(source[start:stop])  # the trainer's hash
        xxhash.xxh3_64_intdigest(written[start:stop])  # the engine's, while the piece is in cache

    def pipelined():
        for f in [_hash_pool().submit(piece, k) for k in range(-(-nbytes // PIECE_BYTES))]:
            f.result()

    limit_s, sequential_s = _alternating(lambda: dst.copy_(src), sequential, repeats)
    pipelined_s = median_seconds(pipelined, repeats=repeats)
    return _line("shm", nbytes, "memcpy", limit_s, min(sequential_s, pipelined_s),
                 sequential_seconds=round(sequential_s, 5), pipelined_seconds=round(pipelined_s, 5))


def _gloo_peer(rank: int, port: int, nbytes: int, repeats: int) -> None:
    """One side of the gloo floor; rank 0 prints the medians as JSON."""
    from services.weights.broadcast import WeightGroup
    from services.weights.fingerprint import IncrementalFingerprint, fingerprint

    group = WeightGroup(master_address="127.0.0.1", master_port=port, rank=rank, world_size=2, group_name="floor",
                        backend="gloo", timeout_s=120, device=torch.device("cpu")).connect()
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    token = torch.zeros(8, dtype=torch.uint8)

    def once(mode: str) -> float:
        group.broadcast_buckets([token], src=0)  # both sides start together
        start = time.perf_counter()
        if rank == 0 and mode == "sequential":
            fingerprint(flat, "xxh3")
            group.broadcast_buckets([flat], src=0)
        elif rank == 0 and mode == "overlapped":
            hashed = IncrementalFingerprint(flat)
            hashed.filled(nbytes)  # every piece queued on the hash pool at once
            group.broadcast_buckets([flat], src=0)
            hashed.result()
        elif rank == 1 and mode != "bare":
            hashed = IncrementalFingerprint(flat)
            group.broadcast_buckets([flat], src=0, on_part=lambda _, n: hashed.filled(n))
            hashed.result()
        else:
            group.broadcast_buckets([flat], src=0)
        mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64).view(torch.uint8).clone()
        group.broadcast_buckets([mine], src=1)  # rank 0 learns when the engine finished
        return mine.view(torch.float64).item() if rank == 0 else 0.0

    modes = ("bare", "sequential", "overlapped")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for mode in modes:
        once(mode)  # warm-up
    for _ in range(repeats):
        for mode in modes:
            times[mode].append(once(mode))
    if rank == 0:
        print(json.dumps({m: statistics.median(t) for m, t in times.items()}), flush=True)
    group.close()
    os._exit(0)  # gloo's destructor aborts at interpreter exit


def gloo_floor(nbytes: int, repeats: int) -> dict:
    out = two_ranks(lambda rank, port: [sys.executable, __file__, "--gloo-peer", str(rank), str(port), str(nbytes),
                                        str(repeats)])
    medians = json.loads(out.strip().splitlines()[-1])
    return _line("broadcast", nbytes, "gloo_broadcast", medians["bare"], min(medians["sequential"], medians["overlapped"]),
                 backend="gloo", sequential_seconds=round(medians["sequential"], 5),
                 overlapped_seconds=round(medians["overlapped"], 5))


# ---- GPU ----------------------------------------------------------------------------------------
def cuda_ipc_floor(nbytes: int, repeats: int, bucket_bytes: int) -> dict:
    from services.weights import fast_cuda

    device = torch.device("cuda", 0)
    sizes = [min(bucket_bytes, nbytes - start) for start in range(0, nbytes, bucket_bytes)]
    trainer = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=device) for n in sizes]
    engine = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    src, dst = torch.cat(trainer), torch.empty(nbytes, dtype=torch.uint8, device=device)

    def limit():
        dst.copy_(src)
        torch.cuda.synchronize(device)

    def floor():
        expected = fast_cuda.fingerprints(trainer)  # GetWeightManifest
        if fast_cuda.copy_and_fingerprint(zip(engine, trainer)) != expected:  # the engine's copy
            raise AssertionError("cuda_ipc floor: the copy does not verify")

    limit_s, floor_s = _alternating(limit, floor, repeats)
    return _line("cuda_ipc", nbytes, "d2d_copy", limit_s, floor_s, buckets=len(sizes))


def cuda_ipc_host_floor(nbytes: int, repeats: int, bucket_bytes: int) -> dict:
    from services.weights import fast_cuda

    device = torch.device("cuda", 0)
    sizes = [min(bucket_bytes, nbytes - start) for start in range(0, nbytes, bucket_bytes)]
    host = [torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory() for n in sizes]
    expected = fast_cuda.fingerprints([h.to(device) for h in host])  # captured at Sleep, not part of a sync
    engine = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    src, dst = torch.cat(host).pin_memory(), torch.empty(nbytes, dtype=torch.uint8, device=device)

    def limit():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    def floor():
        if fast_cuda.copy_and_fingerprint(zip(engine, host)) != expected:
            raise AssertionError("cuda_ipc_host floor: the upload does not verify")

    limit_s, floor_s = _alternating(limit, floor, repeats)
    return _line("cuda_ipc_host", nbytes, "pinned_h2d", limit_s, floor_s, buckets=len(sizes))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=463, help="bytes moved, in MB (default: the 512 MB bench model's 463)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bucket-mb", type=int, default=512, help="bucket size in MiB (GPU planes)")
    parser.add_argument("--json", action="store_true", help="JSON lines only on stdout (progress on stderr)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gloo-peer", nargs=4, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gloo_peer:
        _gloo_peer(*args.gloo_peer)
    nbytes = args.mb * 1_000_000 // 16 * 16
    if args.device == "cpu":
        planes = [("shm", lambda: shm_floor(nbytes, args.repeats)), ("broadcast", lambda: gloo_floor(nbytes, args.repeats))]
    else:
        bucket = args.bucket_mb << 20
        planes = [("cuda_ipc", lambda: cuda_ipc_floor(nbytes, args.repeats, bucket)),
                  ("cuda_ipc_host", lambda: cuda_ipc_host_floor(nbytes, args.repeats, bucket))]
    for name, measure in planes:
        print(f"{name}: {nbytes / 1e6:.0f} MB ...", file=sys.stderr, flush=True)
        line = measure()
        emit(line, args.out)
        if not args.json:
            print(f"  {name}: limit {line['limit_seconds'] * 1e3:.1f} ms, verified floor {line['floor_seconds'] * 1e3:.1f} ms "
                  f"-> floor_ratio {line['floor_ratio']:.2f} (goal {line['goal']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
