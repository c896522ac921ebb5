"""Experiment (2026-12-03, session 23): the decode step with its cuBLAS products on cuBLASLt's
fastest algorithm that gives F.linear's bits (`TritonOps.tune_products`, `cublaslt.choose`)
against F.linear, variants alternating in one process (`alternate.py`).

    python bench/experiments/lt_step.py [variants] [batches]   # e.g. f_linear,lt,lt_prefill 64,256

Session 19's `lt_algos.py step` took the fastest candidate whatever its bits (0.5B batch 256
1331 -> 1305 us); the engine takes only candidates with F.linear's bits, so that a choice made
by timing never changes a token. Each line gives the step and the greedy tail (the same in both
variants, or the bits moved); after each batch, the products tuned and their candidates.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import ONE, alternate, cli, greedy_tail  # noqa: E402
from bench.rollout import timed  # noqa: E402

# name: products tuned up to this many rows (0: none). `lt_prefill` tunes the prefill's products
# too (the 1-token call, a 256 x 64 prefill, shows them).
VARIANTS = {"f_linear": 0, "lt": 512, "lt_prefill": 16384}


def main() -> None:
    names, batches = cli(VARIANTS, [64, 256])

    def apply(core, name):
        core.ops.tune_products = VARIANTS[name] > 0
        core.ops.tune_max_rows = max(VARIANTS[name], 512)

    def describe(core, prompts):
        one = sorted(timed(lambda: core.generate(prompts, ONE), "cuda") for _ in range(3))[1]
        return f"1-token call {one * 1e3:.2f} ms  {greedy_tail(core, prompts)}"

    def after(shape, batch, core, prompts):
        for key, product in core.ops._products.items():
            if key[2] in (core.runner.bucket(batch), batch * 64):
                chosen = "F.linear" if product is None else f"#{product.chosen.index} tile {product.chosen.tile}"
                print(f"   {shape} {key[2]} x {key[3]} x {key[4]}: {chosen}", flush=True)

    alternate(names, batches, apply, describe=describe, after=after)


if __name__ == "__main__":
    main()
