"""Experiment (2026-12-02, session 19): does cuBLASLt have a faster algorithm for the decode
step's products than the one its heuristic proposes first (the one `F.linear` runs)?

    python bench/experiments/lt_algos.py screen            # each product alone
    python bench/experiments/lt_algos.py step [batches]    # in the decode step, variants alternating
    python bench/experiments/lt_algos.py prefill           # the prefill's attention, SDPA backends

`screen`: every product of both shapes at 16, 64 and 256 rows, as a CUDA graph of 20 calls, each
on its own copy of the weights (together past L2, as the step streams them); every candidate the
heuristic lists (32 at most), the default's time, the fastest's, its config, whether it gives the
same bits twice and how far from F.linear's.
`step`: the engine with its products (bar the output embedding) on the fastest candidate of
each shape, against the engine as it is (`bench/experiments/alternate.py`).

Found (H200, `bench/results/lt_algos-experiment-*`): the heuristic lists 8 candidates; the
fastest beats the first by 0-10% a product (0.5B gate/up at 256 rows 10.8 -> 10.1 us, down
10.3 -> 9.8), which in the step is 0.5B batch 256 1331 -> 1305 us (-2%), batch 16 unchanged,
1.5B batch 16 1458 -> 1443. Not taken into the engine: a choice made by timing can differ
between runs and machines, and with it the bits of every product, so that a seed would no
longer give the same samples on a restart. `prefill`: for 256 prompts of 64 tokens cuDNN's
kernel (75 us a layer) is within 2 us of the others that take grouped heads as they are;
memory-efficient attention takes 49 us but only on heads repeated to match, which costs its own
copies. The prefill keeps cuDNN.

Since session 23 the engine does take cuBLASLt's candidates, those that give F.linear's bits
(`services/rollout/builtin/cublaslt.py`, whose binding `bench/experiments/cublaslt.py` now extends).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.cublaslt import LtLinear  # noqa: E402
from services.rollout.builtin import cublaslt  # noqa: E402

SHAPES = {  # name: (n_out, k, bias)
    "0.5b qkv": (1152, 896, True), "0.5b o": (896, 896, False), "0.5b gate_up": (9728, 896, False),
    "0.5b down": (896, 4864, False),
    "1.5b qkv": (2048, 1536, True), "1.5b o": (1536, 1536, False), "1.5b gate_up": (17920, 1536, False),
    "1.5b down": (1536, 8960, False),
}
CALLS = 20


def graph_us(fn) -> float:
    """Microseconds a call of fn(i), CALLS of them back to back in a CUDA graph (the engine's timing)."""
    return cublaslt.graph_us(fn, CALLS)


def tune(lt: LtLinear, x, weights, bias):
    """(default us, best us, best candidate, all [(us, candidate)])"""
    cands = lt.candidates(32)
    default = graph_us(lambda i: torch.addmm(bias, x, weights[i % len(weights)].t()) if bias is not None
                       else F.linear(x, weights[i % len(weights)]))
    timed = []
    for c in cands:
        try:
            timed.append((graph_us(lambda i, c=c: lt.run(x, weights[i % len(weights)], bias, c)), c))
        except RuntimeError as e:
            print(f"   candidate {c.index} failed: {e}", flush=True)
    timed.sort(key=lambda t: t[0])
    return default, timed


def screen() -> None:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    read_us = graph_us(lambda i: src.view(torch.int64).sum())
    bw = (1 << 30) / read_us / 1e6
    print(f"# read bandwidth {bw:.2f} TB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k, has_bias) in SHAPES.items():
        copies = max(1, -(-(160 << 20) // (n * k * 2)))
        weights = [(torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) for _ in range(copies)]
        bias = (torch.randn(n, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) if has_bias else None
        for rows in (16, 64, 256):
            x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
            lt = LtLinear(rows, n, k, torch.bfloat16, has_bias, x.device)
            default, timed = tune(lt, x, weights, bias)
            if not timed:
                print(f"{name:13s} b{rows:<4d} no candidates", flush=True)
                continue
            best_us, best = timed[0]
            ref = F.linear(x, weights[0], bias)
            a = lt.run(x, weights[0], bias, best)
            b = lt.run(x, weights[0], bias, best)
            first = [t for t in timed if t[1].index == 0]
            print(f"{name:13s} b{rows:<4d} at bandwidth {n * k * 2 / bw / 1e6:5.1f} us  F.linear {default:6.1f}  "
                  f"lt[0] {first[0][0] if first else float('nan'):6.1f}  best {best_us:6.1f} (#{best.index} of "
                  f"{len(timed)}, {best.config}, waves {best.waves:.2f})  same bits twice {torch.equal(a, b)}  "
                  f"max |diff| vs F.linear {(a.float() - ref.float()).abs().max().item():.3g}", flush=True)
            print("     next: " + "  ".join(f"#{c.index} {us:.1f} {c.config.get('tile')}/{c.config.get('splitk')}"
                                          for us, c in timed[1:6]), flush=True)


def prefill() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for groups, length, heads, kv, dim in ((256, 64, 14, 2, 64), (256, 64, 12, 2, 128), (64, 256, 14, 2, 64),
                                           (16, 1024, 14, 2, 64)):
        q = torch.randn(groups, heads, length, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(groups, kv, length, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(groups, kv, length, dim, device="cuda", dtype=torch.bfloat16)
        ref = None
        line = []
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            for gqa in (True, False):
                kk, vv = (k, v) if gqa else (k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1))
                try:
                    with sdpa_kernel(backend):
                        fn = lambda i: F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=gqa)
                        out = fn(0)
                        us = graph_us(fn)
                    ref = out if ref is None else ref
                    line.append(f"{backend.name[:6]}{'/gqa' if gqa else '/rep'} {us:6.1f} us "
                                f"(diff {(out.float() - ref.float()).abs().max().item():.2g})")
                except RuntimeError as e:
                    line.append(f"{backend.name[:6]}{'/gqa' if gqa else '/rep'} fails ({str(e)[:60]})")
        print(f"prefill attention {groups}x{length} heads {heads}/{kv} dim {dim}: " + "; ".join(line), flush=True)


def step(batches: list[int]) -> None:
    from bench.experiments.alternate import alternate, greedy_tail
    from services.rollout.builtin.kernels import TritonOps

    tuned: dict[tuple, LtLinear] = {}

    class LtOps(TritonOps):
        def linear(self, x, weight, bias=None):
            if self._skinny(x, weight) or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.shape[0] > 512:
                return super().linear(x, weight, bias)
            key = (x.shape[0], weight.shape[0], weight.shape[1], bias is not None)
            lt = tuned.get(key)
            if lt is None:
                if torch.cuda.is_current_stream_capturing():
                    return super().linear(x, weight, bias)
                lt = LtLinear(*key[:3], x.dtype, bias is not None, x.device)
                copies = max(1, -(-(160 << 20) // (weight.numel() * 2)))
                weights = [weight.clone() for _ in range(copies)]
                default, timed = tune(lt, x.clone(), weights, bias)
                lt.chosen = timed[0][1] if timed and timed[0][0] < default else None
                print(f"   tuned {key}: F.linear {default:.1f} us, best #{timed[0][1].index} {timed[0][0]:.1f} us"
                      f" {timed[0][1].config}", flush=True)
                tuned[key] = lt
                del weights
            if lt.chosen is None:
                return super().linear(x, weight, bias)
            return lt.run(x, weight, bias)

    base_ops, lt_ops = {}, {}

    def apply(core, name):
        if not base_ops:
            base_ops["ops"] = core.ops
            lt_ops["ops"] = LtOps()
        ops = lt_ops["ops"] if name == "lt" else base_ops["ops"]
        core.ops = ops
        core.runner.decoder.ops = ops

    alternate(["base", "lt"], batches, apply, describe=greedy_tail)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "screen"
    if mode == "screen":
        screen()
    elif mode == "prefill":
        prefill()
    else:
        step([int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 64, 256])
