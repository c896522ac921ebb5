"""Where a weight sync spends its time: every RPC of each sync, timed as the coordinator sees it.

A diagnostic beside bench/weight_sync.py (which reports throughput against physical limits):
starts a trainer and an engine, syncs a model of --mb megabytes over each plane a few times and
prints the time of GetWeightManifest, PushWeights, UpdateWeights and ReleaseWeights per sync.

    python bench/sync_phases.py --planes shm,grpc_stream,broadcast --mb 512
    python bench/sync_phases.py --device cuda --planes cuda_ipc,cuda_ipc_host --mb 2200
    python bench/sync_phases.py --device cuda --planes broadcast,broadcast_host --mb 2200  # two GPUs
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.weight_sync import configure, make_model, placement, syncer_for, trainer_and_engine  # noqa: E402
from services import profiling  # noqa: E402
from services.api import trainer_pb2  # noqa: E402
from services.coordinator.clients import RolloutClient, TrainerClient  # noqa: E402

TIMED = {TrainerClient: ("weight_manifest", "push_weights", "release_weights"), RolloutClient: ("update_weights",)}


def _timed(cls, name: str, phases: list[str]) -> None:
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            phases.append(f"{name} {1e3 * (time.perf_counter() - start):.1f} ms")

    setattr(cls, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument("--planes", default="grpc_stream,shm,broadcast")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--log-lines", type=int, default=12, help="how much of each service's log to print")
    parser.add_argument("--debug", action="store_true", help="services log at debug level (finer splits)")
    parser.add_argument("--profile", type=Path, help="write a torch.profiler trace of every update here")
    args = parser.parse_args(argv)
    phases: list[str] = []
    for cls, names in TIMED.items():
        for name in names:
            _timed(cls, name, phases)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        print(f"model: {make_model(model, args.mb) / 1e6:.0f} MB", flush=True)
        pool = ThreadPoolExecutor(8)
        env = {profiling.ENV: str(args.profile.resolve())} if args.profile else None
        with trainer_and_engine(Path(tmp), "debug" if args.debug else "info", env) as (fleet, trainer, engine):
            sample = trainer_pb2.Sample(prompt_ids=[3, 4], response_ids=[5], advantage=1.0)
            for name in args.planes.split(","):
                from_host, plane = name.endswith("_host"), name.removesuffix("_host")
                device, engine_device = placement(args.device, plane)
                configure(trainer, engine, model, device, offload=from_host, engine_device=engine_device)
                syncer = syncer_for(trainer, [engine], plane, pool)
                for i in range(args.syncs):
                    trainer.train_step(trainer_pb2.Batch(samples=[sample]))
                    if from_host:
                        trainer.sleep()
                    phases.clear()
                    start = time.perf_counter()
                    result = syncer.sync({0})
                    total = 1e3 * (time.perf_counter() - start)
                    failed = f" FAILED {result.failures}" if result.failures else ""
                    print(f"{name} sync {i}: {total:.1f} ms ({', '.join(phases)}){failed}", flush=True)
                syncer.close()
            for child in fleet.children:
                print(f"{child.role} log (the last {args.log_lines} lines):", flush=True)
                print(child.log_tail(args.log_lines), flush=True)
        pool.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
