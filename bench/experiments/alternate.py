"""The loop the decode-step experiments share: for each shape and batch, every variant in turn
(twice round), its graphs captured again, its decode step timed as (a call making 128 tokens - a
call making 1) / 127, the median of 3; one line per timing and a summary per batch."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import VOCAB, _Ids, make_model, timed  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

FULL = Sampling(temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=1)
ONE = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=1)


def step_us(core: GenerationCore, prompts: list[list[int]]) -> float:
    steps = [(timed(lambda: core.generate(prompts, FULL), "cuda") - timed(lambda: core.generate(prompts, ONE), "cuda"))
             / 127 for _ in range(3)]
    return sorted(steps)[1] * 1e6


def alternate(names: list[str], batches: list[int], apply: Callable[[GenerationCore, str], None], *,
              describe: Callable[[GenerationCore, list[list[int]]], str] | None = None,
              after: Callable[[str, int, GenerationCore, list[list[int]]], None] | None = None,
              shapes: tuple[str, ...] = ("0.5b", "1.5b")) -> None:
    """`apply(core, name)` sets a variant's knobs; `describe` adds to its line (first tokens, say);
    `after(shape, batch, core, prompts)` runs once a batch's variants are done."""
    for shape in shapes:
        model = make_model(shape, torch.bfloat16, "cuda")
        core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=256))
        rng = random.Random(0)
        for batch in batches:
            prompts = [[rng.randrange(VOCAB) for _ in range(64)] for _ in range(batch)]
            results: dict[str, list[float]] = {}
            for _round in range(2):
                for name in names:
                    core.generate(prompts[:1], ONE)  # the runner exists
                    apply(core, name)
                    core.runner.drop_graphs()
                    core.generate(prompts, FULL)  # compile, capture
                    us = step_us(core, prompts)
                    results.setdefault(name, []).append(us)
                    extra = f"  {describe(core, prompts)}" if describe else ""
                    print(f"{shape} b{batch} {name:26s} step {us:7.1f} us{extra}", flush=True)
            print("# summary", shape, batch, {k: [round(v, 1) for v in vs] for k, vs in results.items()}, flush=True)
            if after is not None:
                after(shape, batch, core, prompts)
        core = model = None
        torch.cuda.empty_cache()


def greedy_tail(core: GenerationCore, prompts: list[list[int]]) -> str:
    """The last 4 of 16 greedy tokens of the first two prompts: a variant that computes something
    else shows here."""
    greedy = Sampling(temperature=0.0, max_new_tokens=16, ignore_eos=True, seed=1)
    return f"greedy tail {[r.output_ids[-4:] for r in core.generate(prompts[:2], greedy)]}"


def cli(variants: dict, batches: list[int]) -> tuple[list[str], list[int]]:
    """[variants, comma-separated] [batches, comma-separated] from the command line, or all and `batches`."""
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(variants)
    return names, [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else batches
