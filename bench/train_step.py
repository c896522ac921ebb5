"""Train-step throughput of the trainer backends (torch, megatron), side by side, as MFU.

One RL train step (PPO-clip loss with old logprobs, bf16 weights, fp32 master weights and AdamW)
over `--batch` sequences of `--seq` tokens, on the Qwen2-0.5B and 1.5B shapes with random
weights. MFU is 6 * parameters * tokens / step time against the datasheet dense bf16 peak
(989 TFLOP/s on an H200); the bf16 matmul rate measured in the same run is the physical limit
beside it (`ratio_to_matmul`). Attention FLOPs are not counted, as the 6N rule does not.

    python bench/train_step.py --json --out run.jsonl --png bench/results/train_step-<machine>.png && python bench/common.py publish train_step run.jsonl
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import commit, emit, machine  # noqa: E402
from bench.rollout import SHAPES, VOCAB  # noqa: E402
from services.models import DecoderLM, ModelConfig, save_hf_dir  # noqa: E402
from services.trainer.backend import build_backend  # noqa: E402
from services.trainer.batch import Sample  # noqa: E402
from services.trainer.settings import OptimizerSettings, TrainerSettings  # noqa: E402

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0}


def log(message: str) -> None:
    print(f"[train_step {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def peak_tflops() -> float | None:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def matmul_tflops(device: str, n: int = 8192, repeats: int = 20) -> float:
    """The dense bf16 matmul rate this device reaches now (the physical limit of this run)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - started) / 1e12


def make_checkpoint(shape: str, directory: Path, device: str) -> Path:
    config = ModelConfig(architecture="qwen2", vocab_size=VOCAB, tie_word_embeddings=True,
                         max_position_embeddings=4096, torch_dtype="bfloat16", **SHAPES[shape])
    with torch.device("meta"):
        model = DecoderLM(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    save_hf_dir(model, config, directory)
    del model
    return directory


def make_batch(batch: int, seq: int, prompt: int = 64) -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(batch):
        ids = torch.randint(10, VOCAB - 10, (seq,), generator=gen).tolist()
        n = seq - prompt
        samples.append(Sample(prompt_ids=ids[:prompt], response_ids=ids[prompt:],
                              advantages=torch.randn(n, generator=gen).tolist(), old_logprobs=[-12.0] * n))
    return samples


def measure(backend: str, model_dir: Path, samples: list[Sample], args) -> dict:
    settings = TrainerSettings(
        model_path=str(model_dir), backend=backend, device=args.device, dtype="bfloat16", master_weights="fp32",
        micro_batch_size=args.micro_batch, optimizer=OptimizerSettings(lr=1e-6), compile=not args.eager,
    )
    trainer = build_backend(settings)
    try:
        num_params = trainer.num_parameters
        times = []
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            started = time.perf_counter()
            metrics = trainer.train_step(samples).metrics
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - started)
            log(f"{backend}: step {i + 1}/{args.warmup + args.steps}: {time.perf_counter() - started:.2f} s "
                f"(loss {metrics['loss']:.4f})")
        peak_mem = torch.cuda.max_memory_allocated() / 2**30
        if args.profile:  # where one more step's time goes, by kernel
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                trainer.train_step(samples)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.profile_rows,
                                              max_name_column_width=90)
            print(table, file=sys.stderr, flush=True)
    finally:
        trainer.close()
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return {"num_parameters": num_params, "step_s": statistics.median(times), "peak_gib": round(peak_mem, 1)}


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    backends = sorted({r["backend"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(backends)
    for k, backend in enumerate(backends):
        values = [next((r["mfu"] for r in rows if r["shape"] == s and r["backend"] == backend), 0) for s in shapes]
        ax.bar([i + k * width for i in range(len(shapes))], values, width, label=backend)
    ax.set_xticks([i + width * (len(backends) - 1) / 2 for i in range(len(shapes))], shapes)
    ax.set_ylabel("MFU (6N / 989 TFLOP/s)")
    ax.set_title(f"train step, {rows[0]['machine']}, {rows[0]['commit']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--backends", default="torch,megatron")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="print a kernel profile of one more step")
    parser.add_argument("--profile-rows", type=int, default=40, help="kernels listed by --profile")
    parser.add_argument("--eager", action="store_true", help="no torch.compile of the decoder layers (the default compiles)")
    parser.add_argument("--json", action="store_true", help="(the lines are JSON either way)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("train_step: needs a CUDA device", file=sys.stderr)
        return 2
    peak = peak_tflops()
    matmul = matmul_tflops(args.device)
    log(f"bf16 matmul: {matmul:.0f} TFLOP/s; datasheet peak {peak} TFLOP/s")
    samples = make_batch(args.batch, args.seq)
    tokens = args.batch * args.seq
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            model_dir = make_checkpoint(shape, Path(tmp) / shape, args.device)
            for backend in args.backends.split(","):
                log(f"{shape} {backend}: {args.batch} x {args.seq} tokens, micro-batch {args.micro_batch}")
                try:
                    result = measure(backend, model_dir, samples, args)
                except Exception as e:  # one backend failing must not hide the others' numbers
                    log(f"{shape} {backend} failed: {type(e).__name__}: {e}")
                    emit({"metric": "train_step", "shape": shape, "backend": backend, "error": f"{type(e).__name__}: {e}"[:500],
                          "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine()}, args.out)
                    continue
                tflops = 6 * result["num_parameters"] * tokens / result["step_s"] / 1e12
                row = {
                    "metric": "train_step", "shape": shape, "backend": backend, "tokens": tokens,
                    "tokens_per_s": round(tokens / result["step_s"]), "tflops_6n": round(tflops, 1),
                    "mfu": round(tflops / peak, 3) if peak else None, "peak_tflops": peak,
                    "matmul_tflops": round(matmul, 1), "ratio_to_matmul": round(tflops / matmul, 3),
                    **result, "step_s": round(result["step_s"], 3), "micro_batch": args.micro_batch,
                    "compile": not args.eager,
                    "date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": machine(),
                }
                rows.append(row)
                emit(row, args.out)
    if args.png and rows:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
