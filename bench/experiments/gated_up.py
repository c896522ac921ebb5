"""Experiment (2026-12-03, session 25): the gated MLP's first product and its SiLU as one CUDA C
kernel (`gated_up.cu`: wgmma, TMA, the token tile multicast across a cluster, the weight's first
tiles asked for before the PDL wait; built by `gated_up_build.py`), against cuBLAS and the SiLU
kernel. Not kept: slower alone and in the step (bench/results/gated_up-experiment-*).

    python bench/experiments/gated_up.py micro                 # each variant alone: bits, error, time
    python bench/experiments/gated_up.py step [variants] [batches]   # in the decode step, alternating
    python bench/experiments/gated_up.py trace                 # where one program's time goes

`micro`: for each shape and row count, the kernel's output against a float64 reference
(‖out - ref‖ / ‖ref‖) and against the engine's present path (cuBLAS's product, then the SiLU
kernel: the share of bit-equal elements and the largest difference), every element written (the
output is poisoned with NaN first), and its time alone in a CUDA graph over weight copies past
L2, as the engine's tuning times products. `step`: the 0.5B decode step with the kernel on and
off (the engine's `gated_mlp` op replaced for the variant), variants alternating in one process
(`alternate.py`). `trace`: where one program's time goes, from %globaltimer stamps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments import gated_up_build as cuda_kernels  # noqa: E402
from services.rollout.builtin import cublaslt  # noqa: E402

SHAPES = {"0.5b": (896, 4864), "1.5b": (1536, 8960)}  # hidden (k), intermediate (I)
CASES = [("0.5b", 256), ("0.5b", 192), ("0.5b", 128), ("0.5b", 64), ("0.5b", 32), ("1.5b", 256), ("1.5b", 64)]


def micro() -> None:
    from services.rollout.builtin.kernels import TritonOps

    lib = cuda_kernels.gated_up_library()
    assert lib is not None, "the CUDA C kernels did not build here"
    ops = TritonOps(pdl=False)
    torch.manual_seed(0)
    for shape, rows in CASES:
        k, inter = SHAPES[shape]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(2 * inter, k, device="cuda") * k**-0.5).to(torch.bfloat16)
        engine = ops.silu_mul(*F.linear(x, w).chunk(2, dim=-1))
        gate, up = (x.double() @ w.double().t()).chunk(2, dim=-1)
        reference = F.silu(gate) * up
        copies = w.expand(max(1, -(-cublaslt.TIMED_BYTES // (w.numel() * 2))), *w.shape).contiguous()
        outs = torch.empty(len(copies), rows, inter, device="cuda", dtype=torch.bfloat16)
        base_us = cublaslt.graph_us(lambda i: ops.silu_mul(*F.linear(x, copies[i % len(copies)]).chunk(2, dim=-1)), 20)
        lt = cublaslt.choose(x, w, None, min_gain=0.0)
        lt_us = base_us if lt is None else cublaslt.graph_us(
            lambda i: ops.silu_mul(*lt.run(x, copies[i % len(copies)], None).chunk(2, dim=-1)), 20)
        print(f"{shape} {rows} rows: F.linear + SiLU {base_us:.1f} us, engine's cuBLASLt + SiLU {lt_us:.1f} us", flush=True)
        for tokens in sorted(t for t in cuda_kernels.VARIANTS if t >= rows)[:2]:
            for cluster in (1, 2, 4):
                name = f"{tokens} tokens cluster {cluster}"
                out = torch.full((rows, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
                try:
                    lib.gated_up(x, w, out, tokens=tokens, cluster=cluster, pdl=False)
                    torch.cuda.synchronize()
                except cuda_kernels.KernelError as exc:
                    print(f"   {name}: {exc}", flush=True)
                    continue
                unwritten = int(out.isnan().sum())
                error = float((out.double() - reference).norm() / reference.norm())
                equal = float((out == engine).float().mean())
                most = float((out.float() - engine.float()).abs().max())
                us = cublaslt.graph_us(lambda i: lib.gated_up(x, copies[i % len(copies)], outs[i % len(copies)],
                                                              tokens=tokens, cluster=cluster, pdl=False), 20)
                print(f"   {name}: {us:6.1f} us  rel err {error:.2e}  unwritten {unwritten}  "
                      f"bit-equal to the engine's {equal:.4f} (max diff {most:.3g})", flush=True)


def trace() -> None:
    """Where a program's time goes: %globaltimer stamps (ns from the program's start, mean over
    programs) at the cluster sync, each tile's arrival (the consumer's wait on it done), each
    stage's release seen by the producer, the main loop's end, the epilogue's exchange, the stores."""
    lib = cuda_kernels.gated_up_library()
    assert lib is not None
    torch.manual_seed(0)
    k, inter = SHAPES["0.5b"]
    for rows in (256, 64):
        tokens = min(t for t in cuda_kernels.VARIANTS if t >= rows)
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        copies = (torch.randn(8, 2 * inter, k, device="cuda") * k**-0.5).to(torch.bfloat16)
        out = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)
        programs = -(-inter // cuda_kernels.WEIGHT_ROWS)
        for cluster in (1, 2):
            for i in range(3):  # warm: built, attributes set
                lib.gated_up(x, copies[i], out, tokens=tokens, cluster=cluster, pdl=False)
            stamps = torch.zeros(programs + 4, 48, dtype=torch.int64, device="cuda")
            lib.gated_up(x, copies[5], out, tokens=tokens, cluster=cluster, pdl=False, trace=stamps)
            torch.cuda.synchronize()
            st = stamps[:programs].double()
            rel = (st - st[:, :1]) / 1e3  # us from each program's start
            span = float((st[:, 5].max() - st[:, 0].min()) / 1e3)
            starts = float((st[:, 0].max() - st[:, 0].min()) / 1e3)
            mean = rel.mean(0)
            arrivals = " ".join(f"{float(v):.2f}" for v in mean[8:8 + 14])
            releases = " ".join(f"{float(v):.2f}" for v in mean[32:32 + 14 - cuda_kernels.VARIANTS[tokens]])
            print(f"{rows} rows ({tokens} tokens, cluster {cluster}): kernel span {span:.2f} us, programs start within "
                  f"{starts:.2f} us; mean us from a program's start: cluster sync {float(mean[1]):.2f}, producer past "
                  f"its wait {float(mean[2]):.2f}, main loop done {float(mean[3]):.2f}, epilogue exchange done "
                  f"{float(mean[4]):.2f}, stores done {float(mean[5]):.2f}", flush=True)
            print(f"   tiles arrive at {arrivals}", flush=True)
            print(f"   stages released (producer sees) at {releases}", flush=True)


def step() -> None:
    import types

    from bench.experiments.alternate import alternate, cli, greedy_tail
    from services.rollout.builtin.kernels import TritonOps

    lib = cuda_kernels.gated_up_library()
    assert lib is not None
    variants = {"cublas": None, "gated": 2, "gated_c1": 1, "gated_c4": 4}  # cluster size
    names, batches = cli(variants, [64, 256])
    names = [n for n in names if n in variants] or ["cublas", "gated"]

    def gated_mlp(ops, h, gate_up, down, down_bias=None, *, cluster):
        rows = h.shape[0]
        tokens = min((t for t in cuda_kernels.VARIANTS if t >= rows), default=None)
        if rows <= ops.skinny_rows or tokens is None or h.stride(1) != 1:
            return TritonOps.gated_mlp(ops, h, gate_up, down, down_bias)
        act = torch.empty(rows, gate_up.shape[0] // 2, dtype=h.dtype, device=h.device)
        lib.gated_up(h, gate_up, act, tokens=tokens, cluster=cluster, pdl=ops.pdl)
        return ops.linear(act, down, down_bias)

    def apply(core, name):
        cluster = variants[name]
        if cluster is None:
            core.ops.__dict__.pop("gated_mlp", None)
        else:
            core.ops.gated_mlp = types.MethodType(lambda ops, *a, c=cluster: gated_mlp(ops, *a, cluster=c), core.ops)

    def describe(core, prompts):
        from bench.experiments.alternate import ONE
        from bench.rollout import timed

        one = sorted(timed(lambda: core.generate(prompts, ONE), "cuda") for _ in range(3))[1]
        return f"1-token call {one * 1e3:.2f} ms  {greedy_tail(core, prompts)}"

    alternate(names, batches, apply, describe=describe, shapes=("0.5b",))


if __name__ == "__main__":
    mode = sys.argv.pop(1) if len(sys.argv) > 1 else "micro"
    {"micro": micro, "step": step, "trace": trace}[mode]()
