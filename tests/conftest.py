"""Shared fixtures: a tiny Hugging Face-format model made on the fly, and small task data."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

CHARS = "0123456789+-= "


def make_tiny_model(directory: Path, *, seed: int = 0, architecture: str = "qwen3", chars: str = CHARS,
                    **shape) -> Path:
    """A random char-level model in Hugging Face format; `shape` overrides ModelConfig fields."""
    import torch

    from services.models import DecoderLM, ModelConfig, init_weights, make_char_tokenizer, save_hf_dir

    tokenizer = make_char_tokenizer(chars)
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)
    config = ModelConfig(
        architecture=architecture,
        vocab_size=tokenizer.vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **(fields | shape),
    )
    torch.manual_seed(seed)
    model = DecoderLM(config)
    init_weights(model, seed=seed)
    save_hf_dir(model, config, directory)
    tokenizer.save(directory)
    return directory


def make_syncer(trainer, engines, pool, *, plane: str = "auto", exact: bool = False, timeout_s: float):
    """A WeightSyncer over connected clients, with the capabilities they reported at Configure."""
    from services.coordinator.weight_sync import WeightSyncer

    return WeightSyncer(trainer=trainer, engines=engines, trainer_caps=trainer.capabilities,
                        engine_caps=[e.capabilities for e in engines], forced=plane, exact=exact,
                        timeout_s=timeout_s, token="", pool=pool)


def stop_process(pid: int, failure: str, after_s: float = 0.0) -> None:
    """Stop a process mid-sync: SIGSTOP now (or `after_s` from now); with `failure` "killed" it is
    also SIGKILLed a second after that, with "stalled" it stays stopped (the caller kills it)."""
    if after_s:
        threading.Timer(after_s, lambda: os.kill(pid, signal.SIGSTOP)).start()
    else:
        os.kill(pid, signal.SIGSTOP)
    if failure == "killed":
        threading.Timer(after_s + 1.0, lambda: os.kill(pid, signal.SIGKILL)).start()


def stop_fleet(local, log_lines: int = 0) -> None:
    """Stop a LocalFleet whose children a test may have stopped (each gets SIGCONT first, so it
    can exit), printing the last `log_lines` of each child's log (pytest shows them on failure)."""
    for child in local.children:
        try:
            os.kill(child.process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        if log_lines:
            print(f"--- {child.role} log ---\n{child.log_tail(log_lines)}")
    local.stop()


def write_task(directory: Path, num_rows: int, seed: int) -> Path:
    import random

    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rows-{seed}.jsonl"
    with path.open("w") as f:
        for _ in range(num_rows):
            a, b = rng.randrange(10), rng.randrange(10)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory) -> Path:
    """A tiny model with room for prompts and completions of a few hundred tokens (many KV blocks)."""
    return make_tiny_model(tmp_path_factory.mktemp("long-model"), max_position_embeddings=320, architecture="qwen2")


@pytest.fixture(scope="session")
def task_files(tmp_path_factory) -> tuple[Path, Path]:
    directory = tmp_path_factory.mktemp("task")
    return write_task(directory, 64, seed=1), write_task(directory, 16, seed=2)


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory) -> Path:
    """SmolLM2 converted once per test session by the example's own script (float32), for every
    test that needs the real pretrained checkpoint (the conversion takes tens of seconds)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("smollm2") / "model"
    script = Path(__file__).resolve().parents[1] / "examples" / "smollm2" / "make_model.py"
    subprocess.run([sys.executable, str(script), "--out", str(out), "--dtype", "float32"], check=True,
                   capture_output=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return out
