"""An engine's upload of a sleeping trainer's host copy, by the copy engines and by the SMs.

A sync from the host copy starts right after the trainer has gone to sleep and freed its GPU
memory, and the driver scrubs freed memory on the copy engines, beside whatever they upload.
This measures both ways of uploading page-locked shared-memory buckets into device buffers with
their "fast" fingerprints (services/weights/staging.py), with the GPU quiet and right after
another allocation of --free-gib was freed, against a pinned host->device copy of the same bytes
measured in the same run. Prints one JSON line per case.

    python bench/host_upload.py --gb 9 --out run.jsonl && python bench/common.py publish host_upload run.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, record  # noqa: E402
from services.weights import fast_cuda, shm  # noqa: E402
from services.weights.staging import upload_and_fingerprint  # noqa: E402

BUCKET = 512 << 20


def seconds(fn, free_bytes: int = 0, repeats: int = 3) -> float:
    """Median wall time of fn() to completion, each run right after freeing `free_bytes`."""
    times = []
    for _ in range(repeats + 1):
        if free_bytes:
            hog = torch.empty(free_bytes, dtype=torch.uint8, device="cuda")
            hog.fill_(1)
            torch.cuda.synchronize()
            del hog
            torch.cuda.empty_cache()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=9.0, help="bytes to upload, in GB")
    parser.add_argument("--free-gib", type=int, default=26, help="GPU memory freed just before (a trainer's sleep)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_upload: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    count = max(1, round(args.gb * 1e9 / BUCKET))
    total = count * BUCKET
    segments = shm.SharedBuffers([BUCKET] * count, pinned=True, prefix="rlfleet-bench")
    try:
        noise = torch.randint(0, 256, (BUCKET,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        for view in segments.buffers:
            view.copy_(noise)
        host = segments.buffers
        out = [torch.empty(BUCKET, dtype=torch.uint8, device=device) for _ in range(count)]
        pinned = torch.ones(total, dtype=torch.uint8, pin_memory=True)
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        limit = total / seconds(lambda: flat.copy_(pinned, non_blocking=True)) / 1e9
        del flat, pinned
        ways = {"copy_engines": lambda: upload_and_fingerprint(host, device, "fast", out=out, kernel=False)}
        if all(fast_cuda.mapped(h) for h in host):
            ways["sm_kernel"] = lambda: upload_and_fingerprint(host, device, "fast", out=out)
        for name, fn in ways.items():
            for freed in (0, args.free_gib << 30):
                s = seconds(fn, freed)
                print(f"  {name}, {freed >> 30} GiB freed just before: {s * 1e3:.1f} ms", file=sys.stderr, flush=True)
                emit(record(f"host_upload_{name}", total / s / 1e9, limit, way=name, freed_gib=freed >> 30,
                            bytes=total, limit="pinned_h2d", seconds=round(s, 4), num_gpus=torch.cuda.device_count()),
                     args.out)
    finally:
        segments.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
