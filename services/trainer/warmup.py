"""Small policies made from scratch for the examples: a char-level Llama and a supervised warm-up.

The examples' RL jobs need a model that is weak but not hopeless at their task, so that RL has
something to improve, and no download. `make_char_model` writes a random Llama-family model with
a character tokenizer as a Hugging Face directory; `sft_warmup` trains it in process through the
torch trainer backend (`TrainStep` with the SFT loss) on rows of text segments, each segment
trained on or only read (a tool's answer, say), and saves it. Deterministic for a seed on one
CPU thread.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import torch

from services.models import DecoderLM, ModelConfig, init_weights, load_tokenizer, make_char_tokenizer, save_hf_dir
from services.trainer.batch import Sample
from services.trainer.settings import OptimizerSettings, TrainerSettings
from services.trainer.torch_backend import TorchTrainer

Segment = tuple[str, bool]  # (text, trained on)
Row = tuple[str, Sequence[Segment]]  # (prompt, the response's segments; an eos ends it, trained on)


def make_char_model(directory: Path, chars: str, *, words: tuple[str, ...] = (), seed: int, hidden: int,
                    layers: int, heads: int, max_positions: int) -> None:
    tokenizer = make_char_tokenizer(chars, words=words)
    config = ModelConfig(
        architecture="llama",
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = DecoderLM(config)
    init_weights(model, seed=seed)
    save_hf_dir(model, config, directory)
    tokenizer.save(directory)


def sft_warmup(out: Path, rows: Sequence[Row], *, chars: str, words: tuple[str, ...] = (), seed: int = 0,
               hidden: int = 128, layers: int = 2, heads: int = 4, max_positions: int = 64, steps: int = 300,
               batch_size: int = 64, lr: float = 1e-3) -> None:
    """A random char model trained `steps` SFT steps on batches drawn from `rows`, saved to `out`."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        make_char_model(Path(tmp), chars, words=words, seed=seed, hidden=hidden, layers=layers, heads=heads,
                        max_positions=max_positions)
        trainer = TorchTrainer(TrainerSettings(
            model_path=tmp, seed=seed, micro_batch_size=batch_size,
            optimizer=OptimizerSettings(lr=lr, beta2=0.99, grad_clip=1.0),
        ))
        tokenizer = load_tokenizer(tmp)
        rng = random.Random(seed)
        for step in range(1, steps + 1):
            samples = [_sample(tokenizer, prompt, segments) for prompt, segments in rng.sample(rows, batch_size)]
            loss = trainer.train_step(samples, sft=True).metrics["sft_loss"]
            if step % 50 == 0 or step == steps:
                print(f"sft step {step}/{steps}: loss {loss:.4f}", file=sys.stderr, flush=True)
        save_hf_dir(trainer.model, trainer.model_config, out)
        tokenizer.save(out)


def _sample(tokenizer, prompt: str, segments: Sequence[Segment]) -> Sample:
    ids: list[int] = []
    mask: list[float] = []
    for text, trained in segments:
        piece = tokenizer.encode(text)
        ids += piece
        mask += [1.0 if trained else 0.0] * len(piece)
    return Sample(prompt_ids=tokenizer.encode(prompt), response_ids=[*ids, tokenizer.eos_token_id],
                  loss_mask=[*mask, 1.0])


def main(argv: list[str] | None, *, description: str, here: Path, segments: Callable[[dict], Sequence[Segment]],
         chars: str, words: tuple[str, ...] = (), max_positions: int, steps: int) -> int:
    """An example's make_model.py: rows of `here`/data/sft.jsonl (each made into its response's
    segments by `segments`), a warm-up of `steps`, the model written to `here`/model."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--data", type=Path, default=here / "data" / "sft.jsonl")
    parser.add_argument("--out", type=Path, default=here / "model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    sft_warmup(args.out, [(r["prompt"], segments(r)) for r in rows], chars=chars, words=words, seed=args.seed,
               hidden=args.hidden, layers=args.layers, heads=args.heads, max_positions=max_positions,
               steps=args.steps, batch_size=args.batch_size, lr=args.lr)
    print(f"wrote {args.out}")
    return 0
