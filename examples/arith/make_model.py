"""Regenerate the example's small policy: a char-level Llama decoder warmed up by SFT on arithmetic.

The RL example needs a model that is weak but not hopeless at 2-digit addition, so that GRPO has
something to improve. This script makes one from scratch with rlfleet's own parts: a character
tokenizer (`tokenizer.json`), a random Llama-family model saved as a Hugging Face directory, and a
short supervised warm-up through the torch trainer backend (`TrainStep` with the SFT loss, run in
process). The result is written to `model/` beside this script and committed, so `rlfleet run`
needs no download. Deterministic for a seed on one CPU thread.

    python examples/arith/make_model.py            # data/ must exist: python examples/arith/make_data.py
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from services.models import DecoderLM, ModelConfig, init_weights, make_char_tokenizer, save_hf_dir
from services.trainer.batch import Sample
from services.trainer.settings import OptimizerSettings, TrainerSettings
from services.trainer.torch_backend import TorchTrainer

HERE = Path(__file__).resolve().parent
CHARS = "0123456789+-="


def build_random_model(directory: Path, seed: int, hidden: int, layers: int, heads: int) -> None:
    tokenizer = make_char_tokenizer(CHARS)
    config = ModelConfig(
        architecture="llama",
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = DecoderLM(config)
    init_weights(model, seed=seed)
    save_hf_dir(model, config, directory)
    tokenizer.save(directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=HERE / "data" / "sft.jsonl")
    parser.add_argument("--out", type=Path, default=HERE / "model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        build_random_model(Path(tmp), args.seed, args.hidden, args.layers, args.heads)
        trainer = TorchTrainer(
            TrainerSettings(
                model_path=tmp, seed=args.seed, micro_batch_size=args.batch_size,
                optimizer=OptimizerSettings(lr=args.lr, beta2=0.99, grad_clip=1.0),
            )
        )
        from services.models import load_tokenizer

        tokenizer = load_tokenizer(tmp)
        rng = random.Random(args.seed)
        for step in range(1, args.steps + 1):
            batch = rng.sample(rows, args.batch_size)
            samples = [
                Sample(
                    prompt_ids=tokenizer.encode(r["prompt"]),
                    response_ids=[*tokenizer.encode(r["answer"]), tokenizer.eos_token_id],
                )
                for r in batch
            ]
            loss = trainer.train_step(samples, sft=True).metrics["sft_loss"]
            if step % 50 == 0 or step == args.steps:
                print(f"sft step {step}/{args.steps}: loss {loss:.4f}", file=sys.stderr, flush=True)
        save_hf_dir(trainer.model, trainer.model_config, args.out)
        tokenizer.save(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
