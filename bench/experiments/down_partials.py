"""A screening experiment (2026-12-03): the gated MLP's down product of 17-512 rows written as
float32 partial sums over shares of k, which the next residual add + RMSNorm kernel adds in share
order, instead of cuBLAS's split-K product and its separate reduce kernel; and the MLP's first
product with its SiLU in one Triton tile kernel (gate and up columns in one program).

Why: at 256 rows cuBLAS runs the 0.5B down product (k = 4864) as a 64 x 64 split-K kernel and a
`splitKreduce_kernel`, 186 + 58 us a step (bench/results/decode_kernels-*-72da176.jsonl): the
reduce is a launch and a round trip of its own for 256 x 896 numbers, which the norm that reads
the product's output anyway could do. And the SiLU (57 us a step) is a launch whose 2.5 MB
output only the down product reads.

Variants (the attention's products on the tile kernel, as the engine takes them):
  base          the engine as it is
  bmm<S>        down as one `torch.bmm(..., out_dtype=float32)` over S shares of k -> [S, T, N]
  tile<S>       down on a Triton tile kernel (64 x 32, PDL, L2 request) writing S partials
  glu<M>x<N>    gate/up + SiLU in one Triton tile kernel (tiles of M rows by N gate and N up columns)
  a+b           both

Every variant's layer is first checked against the torch reference on random inputs (max abs
error of the normed output, printed), then timed in the step as `alternate.py` does.

    python bench/experiments/down_partials.py [variants] [batches]   # on a GPU
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli, greedy_tail  # noqa: E402
from services.rollout.builtin.kernels import TritonOps  # noqa: E402
from services.rollout.builtin.linear_kernels import _prefetch_l2  # noqa: E402
from services.rollout.builtin.pointwise_kernels import _silu_times  # noqa: E402
from services.rollout.builtin.ops import TorchOps  # noqa: E402

VARIANTS = ["base", "bmm4", "bmm8", "tile4", "glu64x32", "glu128x64", "glu64x32+bmm4"]


@triton.jit
def _parts_add_rmsnorm_kernel(p_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rows, n_cols, stride_res, stride_out,
                              eps, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """(RMSNorm(x + residual), x + residual) with x the sum of PARTS float32 partials [PARTS,
    rows, n_cols] added in order and rounded to the residual's dtype (as a product's output is)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(PARTS):
        acc += tl.load(p_ptr + (s * rows + row) * n_cols + cols, mask=mask, other=0.0)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    x = acc.to(r.dtype)
    x = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)
    tl.store(res_out_ptr + row * stride_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(x.dtype), mask=mask)


@triton.jit
def _tile_parts_kernel(x_ptr, w_ptr, part_ptr, rows, n, k, k_share, stride_x, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LINES: tl.constexpr):
    """part[share] [rows, n] (float32) = x[:, share's k] @ w[:, share's k]^T; one program per
    (tile, share); the weight lines of the share asked of L2 before the wait, as the engine's
    `_tile_linear_kernel` does."""
    pid = tl.program_id(0)
    share = tl.program_id(1)
    m_tiles = tl.cdiv(rows, BLOCK_M)
    m = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < rows
    n_ok = cols < n
    first = share * k_share
    rows_w = w_ptr + cols.to(tl.int64)[:, None] * k + first
    line = tl.arange(0, LINES)
    line_ok = (line % m_tiles == pid % m_tiles) & (line * 64 < k_share)
    _prefetch_l2(tl.where(n_ok[:, None] & line_ok[None, :], rows_w + line[None, :] * 64, w_ptr))
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None] * stride_x + first + kk[None, :]
    w_ptrs = rows_w + kk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, k_share, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(part_ptr + share * rows * n + m[:, None] * n + cols[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _glu_tile_kernel(x_ptr, w_ptr, out_ptr, rows, inter, k, stride_x, stride_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, LINES: tl.constexpr):
    """out [rows, inter] = silu(x @ gate^T) * (x @ up^T), gate the weight's first `inter` rows and
    up the rest, each rounded to x's dtype before the SiLU as the decoder rounds."""
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(rows, BLOCK_M)
    m = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < rows
    n_ok = cols < inter
    gate_w = w_ptr + cols.to(tl.int64)[:, None] * k
    up_w = gate_w + inter * k
    line = tl.arange(0, LINES)
    line_ok = (line % m_tiles == pid % m_tiles) & (line * 64 < k)
    _prefetch_l2(tl.where(n_ok[:, None] & line_ok[None, :], gate_w + line[None, :] * 64, w_ptr))
    _prefetch_l2(tl.where(n_ok[:, None] & line_ok[None, :], up_w + line[None, :] * 64, w_ptr))
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    kk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None] * stride_x + kk[None, :]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for first in range(0, k, BLOCK_K):
        x = tl.load(x_ptrs + first, mask=m_ok[:, None], other=0.0)
        acc_g = tl.dot(x, tl.trans(tl.load(gate_w + first + kk[None, :], mask=n_ok[:, None], other=0.0)), acc_g)
        acc_u = tl.dot(x, tl.trans(tl.load(up_w + first + kk[None, :], mask=n_ok[:, None], other=0.0)), acc_u)
    dtype = out_ptr.dtype.element_ty
    act = _silu_times(acc_g.to(dtype), acc_u.to(dtype))
    tl.store(out_ptr + m[:, None] * stride_out + cols[None, :], act, mask=m_ok[:, None] & n_ok[None, :])


class Patched:
    """TritonOps' linear, silu_mul_linear and add_rmsnorm with the variant's paths for 17-512 rows."""

    glu_min_n = 4096  # the gate/up product's, not the attention's

    def __init__(self, ops: TritonOps, down: str | None, glu: tuple[int, int] | None):
        self.ops, self.down, self.glu = ops, down, glu

    @staticmethod
    def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return 16 < x.shape[0] <= 512 and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and weight.is_contiguous()

    def linear(self, x, weight, bias=None):
        inter = weight.shape[0] // 2
        if (self.glu and bias is None and self._fits(x, weight) and weight.shape[0] >= self.glu_min_n
                and x.stride(1) == 1 and x.shape[1] % 128 == 0):
            # the fused gate/up product: return [T, 2I] whose halves the layer splits; the SiLU'd
            # activation goes in the first half and silu_mul_linear sees it by the marker
            rows, k = x.shape
            out = torch.empty(rows, 2 * inter, dtype=x.dtype, device=x.device)
            bm, bn = self.glu
            _glu_tile_kernel[(triton.cdiv(rows, bm) * triton.cdiv(inter, bn),)](
                x, weight, out, rows, inter, k, x.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128,
                LINES=triton.next_power_of_2(triton.cdiv(k, 64)), num_warps=4 if bm * bn <= 2048 else 8,
                num_stages=3, launch_pdl=True)
            self._activated = out.data_ptr()
            return out
        self._activated = None
        return TritonOps.linear(self.ops, x, weight, bias)

    def silu_mul_linear(self, gate, up, weight, bias=None):
        act = None
        if self.glu and getattr(self, "_activated", None) == gate.data_ptr():
            act = gate  # the glu kernel wrote silu(gate) * up where gate's half is
        self._activated = None
        if self.down is None or bias is not None or not self._fits(gate, weight):
            if act is not None:
                return TritonOps.linear(self.ops, act, weight, bias)
            return TritonOps.silu_mul_linear(self.ops, gate, up, weight, bias)
        if act is None:
            act = self.ops.silu_mul(gate, up)
        rows, k = act.shape
        n = weight.shape[0]
        kind, shares = self.down[:-1], int(self.down[-1])
        if kind == "bmm":
            a = act.view(rows, shares, k // shares).transpose(0, 1)  # [S, T, K/S]
            w = weight.view(n, shares, k // shares).permute(1, 2, 0)  # [S, K/S, N]
            return torch.bmm(a, w, out_dtype=torch.float32)  # [S, T, N]
        part = torch.empty(shares, rows, n, dtype=torch.float32, device=act.device)
        k_share = k // shares
        _tile_parts_kernel[(triton.cdiv(rows, 64) * triton.cdiv(n, 32), shares)](
            act, weight, part, rows, n, k, k_share, act.stride(0), BLOCK_M=64, BLOCK_N=32, BLOCK_K=64,
            LINES=triton.next_power_of_2(triton.cdiv(k_share, 64)), num_warps=4, num_stages=3, launch_pdl=True)
        return part

    def add_rmsnorm(self, x, residual, weight, eps):
        if x.dim() == 2:
            return TritonOps.add_rmsnorm(self.ops, x, residual, weight, eps)
        parts, rows, cols = x.shape
        out = torch.empty(rows, cols, dtype=residual.dtype, device=x.device)
        res_out = torch.empty_like(out)
        _parts_add_rmsnorm_kernel[(rows,)](x, residual, weight, out, res_out, rows, cols, residual.stride(0),
                                           out.stride(0), eps, PARTS=parts, BLOCK=triton.next_power_of_2(cols),
                                           num_warps=4, launch_pdl=True)
        return out, res_out


def parse(name: str) -> tuple[str | None, tuple[int, int] | None]:
    down = glu = None
    for part in name.split("+"):
        if part.startswith(("bmm", "tile")):
            down = part
        elif part.startswith("glu"):
            bm, bn = part[3:].split("x")
            glu = (int(bm), int(bn))
    return down, glu


def check(name: str, hidden: int, inter: int) -> str:
    """The variant's MLP + next norm on random inputs against the torch reference: max abs error."""
    torch.manual_seed(0)
    rows = 256
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * hidden**-0.5
    down_w = torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5
    norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)

    def run(ops):
        gate, up = ops.linear(h, gate_up).chunk(2, dim=-1)
        x = ops.silu_mul_linear(gate, up, down_w)
        return ops.add_rmsnorm(x, res, norm_w, 1e-6)[1]

    ref = run(TorchOps())
    patched = Patched(TritonOps(), *parse(name))
    got = run(patched)
    return f"max abs err of x + residual {float((got.float() - ref.float()).abs().max()):.3g}"


def apply(core, name: str) -> None:
    ops = core.ops
    for attr in ("linear", "silu_mul_linear", "add_rmsnorm"):
        ops.__dict__.pop(attr, None)
    if name == "base":
        return
    patched = Patched(ops, *parse(name))
    ops.linear, ops.silu_mul_linear, ops.add_rmsnorm = patched.linear, patched.silu_mul_linear, patched.add_rmsnorm


def main() -> None:
    names, batches = cli(dict.fromkeys(VARIANTS), [256, 128, 64])
    for name in list(names):
        if name != "base":
            try:
                print(f"# check {name}: 0.5b {check(name, 896, 4864)}; 1.5b {check(name, 1536, 8960)}", flush=True)
            except Exception as exc:  # a variant this torch cannot run is left out, not the run
                print(f"# check {name}: failed, left out: {exc!r}", flush=True)
                names.remove(name)
    alternate(names, batches, apply, describe=greedy_tail)


if __name__ == "__main__":
    main()
