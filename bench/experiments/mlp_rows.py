"""A one-off experiment (2026-12-02; its knob exists at commit a33c6bf only,
so run it there): the decode step at small batches with the MLP's products
(cuBLAS) run at more rows than the batch has (the norm before them writes a padded output; the
rows past the batch are dropped after the down product), since cuBLAS picks its kernel, and how
many SMs it uses, by the row count: at 16 rows the gate/up product of the 0.5B shape runs on 76
of 132 SMs. Alternating in one process on one model (step time = (a call making 128 tokens - a
call making 1) / 127, the median of 3, graphs captured again for each variant).

    python bench/experiments/mlp_rows.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.rollout import VOCAB, _Ids, make_model, timed  # noqa: E402
from services.rollout.builtin.core import CoreSettings, GenerationCore  # noqa: E402
from services.rollout.types import Sampling  # noqa: E402

BASE = dict(mlp_pad_rows=0)
VARIANTS = {
    "rows as they are": {},
    "mlp at 24 rows": dict(mlp_pad_rows=24),
    "mlp at 32 rows": dict(mlp_pad_rows=32),
    "mlp at 48 rows": dict(mlp_pad_rows=48),
    "mlp at 64 rows": dict(mlp_pad_rows=64),
}


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(VARIANTS)
    batches = [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 8, 1]
    for shape in ("0.5b", "1.5b"):
        model = make_model(shape, torch.bfloat16, "cuda")
        core = GenerationCore(model, _Ids(), torch.device("cuda"), CoreSettings(max_batch_size=256))
        rng = random.Random(0)
        for batch in batches:
            prompts = [[rng.randrange(VOCAB) for _ in range(64)] for _ in range(batch)]
            full = Sampling(temperature=1.0, max_new_tokens=128, ignore_eos=True, seed=1)
            one = Sampling(temperature=1.0, max_new_tokens=1, ignore_eos=True, seed=1)
            results = {}
            for _round in range(2):
                for name in names:
                    core.generate(prompts[:1], one)  # the runner exists
                    for knob, value in {**BASE, **VARIANTS[name]}.items():
                        setattr(core.ops, knob, value)
                    core.runner.drop_graphs()
                    core.generate(prompts, full)  # compile, capture
                    steps = []
                    for _ in range(3):
                        steps.append((timed(lambda: core.generate(prompts, full), "cuda")
                                      - timed(lambda: core.generate(prompts, one), "cuda")) / 127)
                    results.setdefault(name, []).append(sorted(steps)[1] * 1e6)
                    print(f"{shape} b{batch} {name:16s} step {sorted(steps)[1] * 1e6:7.1f} us", flush=True)
            print("# summary", shape, batch, {k: [round(v, 1) for v in vs] for k, vs in results.items()}, flush=True)
        core = model = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
