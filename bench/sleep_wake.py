"""Trainer sleep and wake rates against the raw pinned copy rates measured in the same run.

Sleep moves the actor weights and the optimizer state device->host (pinned host store) and frees
the device memory; wake moves them back host->device. The physical limits are one large pinned
device->host and host->device copy. Needs a CUDA device; prints JSON lines
{"metric", "gbps", "limit_gbps", "ratio", ...} and appends them to --out.

    python bench/sleep_wake.py --out run.jsonl && python bench/common.py publish sleep_wake run.jsonl
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import emit, median_seconds, record  # noqa: E402
from services.models import DecoderLM, ModelConfig, init_weights, save_hf_dir  # noqa: E402
from services.trainer.batch import Sample  # noqa: E402
from services.trainer.settings import OptimizerSettings, TrainerSettings  # noqa: E402
from services.trainer.torch_backend import TorchTrainer  # noqa: E402


def big_model(directory: Path, hidden: int, layers: int, vocab: int) -> int:
    config = ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128 // 4,
        head_dim=128, max_position_embeddings=512,
    )
    with torch.device("meta"):
        model = DecoderLM(config)
    model = model.to_empty(device="cpu")
    init_weights(model, seed=0)
    save_hf_dir(model, config, directory)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def raw_copy_gbps(nbytes: int) -> tuple[float, float]:
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def d2h():
        host.copy_(device, non_blocking=True)
        torch.cuda.synchronize()

    def h2d():
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    return nbytes / median_seconds(d2h) / 1e9, nbytes / median_seconds(h2d) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sleep_wake: needs a CUDA device", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        model_bytes = big_model(Path(tmp), args.hidden, args.layers, args.vocab)
        print(f"model: {model_bytes / 1e9:.2f} GB of fp32 weights", file=sys.stderr, flush=True)
        trainer = TorchTrainer(
            TrainerSettings(model_path=tmp, device="cuda", offload=True, optimizer=OptimizerSettings(lr=1e-5))
        )
    samples = [Sample(prompt_ids=list(range(1, 65)), response_ids=list(range(65, 129)), advantages=[1.0] * 64)] * 4
    trainer.train_step(samples)
    state_bytes = sum(t.numel() * t.element_size() for t in trainer._state_tensors() if t.dim() > 0)
    moved = model_bytes + state_bytes
    d2h_limit, h2d_limit = raw_copy_gbps(min(moved, 4 << 30))
    torch.cuda.empty_cache()
    sleeps, wakes = [], []
    for _ in range(args.repeats):
        trainer.train_step(samples)  # a new version, so sleep really captures the weights
        torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.sleep()
        sleeps.append(time.perf_counter() - start)
        start = time.perf_counter()
        trainer.wake()
        wakes.append(time.perf_counter() - start)
    sleep_s, wake_s = sorted(sleeps)[len(sleeps) // 2], sorted(wakes)[len(wakes) // 2]
    common = {"bytes": moved, "model_bytes": model_bytes, "optimizer_bytes": state_bytes}
    emit(record("sleep_d2h", moved / sleep_s / 1e9, d2h_limit, seconds=round(sleep_s, 4), **common), args.out)
    emit(record("wake_h2d", moved / wake_s / 1e9, h2d_limit, seconds=round(wake_s, 4), **common), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
