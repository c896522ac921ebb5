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
from services.rollout.builtin import cublaslt  # noqa: E402

PLAIN_CHOOSE = cublaslt.choose

# name: products tuned up to this many rows (0: none). `lt_prefill` tunes the prefill's products
# too (the 1-token call, a 256 x 64 prefill, shows them). `unsplit`: as `lt_prefill`, and where
# F.linear splits k (no candidate has its bits: the MLP's down product) the fastest candidate
# that does not, whatever its time against F.linear (other bits: an experiment only).
VARIANTS = {"f_linear": 0, "lt": 512, "lt_prefill": 16384, "unsplit": 16384}


def choose_unsplit(x, weight, bias, *, min_gain):
    """`cublaslt.choose`, or where no candidate gives F.linear's bits the fastest candidate that
    sums k in one pass (split-k 1) and gives the same bits as the first such."""
    import torch

    product = PLAIN_CHOOSE(x, weight, bias, min_gain=min_gain)
    if product is not None:
        return product
    rows, k = x.shape
    lt = cublaslt.LtProduct(rows, weight.shape[0], k, x.stride(0), x.dtype, bias is not None, x.device)
    unsplit = [c for c in lt.candidates() if c.splitk == 1]
    if not unsplit or torch.equal(lt.run(x, weight, bias, unsplit[0]), torch.nn.functional.linear(x, weight, bias)):
        return None  # F.linear does not split k: `choose` kept it on purpose
    wanted = lt.run(x, weight, bias, unsplit[0])
    same = [c for c in unsplit if torch.equal(lt.run(x, weight, bias, c), wanted)]
    copies = weight.expand(max(1, -(-cublaslt.TIMED_BYTES // (weight.numel() * 2))), *weight.shape).contiguous()
    timed = sorted((cublaslt.graph_us(lambda i, c=c: lt.run(x, copies[i % len(copies)], bias, c), 10), c.index, c)
                   for c in same)
    f_us = cublaslt.graph_us(lambda i: torch.nn.functional.linear(x, copies[i % len(copies)], bias), 10)
    print(f"   unsplit {rows} x {weight.shape[0]} x {k}: #{timed[0][2].index} tile {timed[0][2].tile} "
          f"{timed[0][0]:.1f} us against F.linear {f_us:.1f} ({len(same)} of {len(unsplit)} with its bits)", flush=True)
    lt.chosen = timed[0][2]
    return lt


def main() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="   %(message)s")
    logging.getLogger("rlfleet.rollout").setLevel(logging.INFO)  # each shape's choice and tuning time
    names, batches = cli(VARIANTS, [64, 256])

    tuned = {}  # variant -> its products by shape

    def apply(core, name):
        core.ops.tune_products = VARIANTS[name] > 0
        core.ops.tune_max_rows = max(VARIANTS[name], 512)
        kind = "unsplit" if name == "unsplit" else "lt"
        core.ops._products = tuned.setdefault(kind, {})
        cublaslt.choose = choose_unsplit if kind == "unsplit" else PLAIN_CHOOSE

    def describe(core, prompts):
        one = sorted(timed(lambda: core.generate(prompts, ONE), "cuda") for _ in range(3))[1]
        return f"1-token call {one * 1e3:.2f} ms  {greedy_tail(core, prompts)}"

    def after(shape, batch, core, prompts):
        for key, product in tuned.get("lt", {}).items():
            if key[2] in (core.runner.bucket(batch), batch * 64):
                chosen = "F.linear" if product is None else f"#{product.chosen.index} tile {product.chosen.tile}"
                print(f"   {shape} {key[2]} x {key[3]} x {key[4]}: {chosen}", flush=True)

    alternate(names, batches, apply, describe=describe, after=after)


if __name__ == "__main__":
    main()
