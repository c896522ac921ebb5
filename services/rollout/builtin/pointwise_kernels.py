"""The decode step's elementwise Triton kernels: the residual add with RMSNorm, and the gated
MLP's activation. Each waits for the kernel before it inside (`gdc_wait`), so that it may be
launched before that one ends (programmatic dependent launch), and rounds where the decoder
rounds (see `ops.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_res, stride_out,
                        eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.extra.cuda.gdc_wait()  # x and the residual come from the kernel before
    tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(res_out_ptr + row * stride_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(x.dtype), mask=mask)


@triton.jit
def _silu_times(gate, up):
    """silu(gate) * up, rounded as the decoder rounds: the activation to gate's dtype, then the product."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_gate, stride_up, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, _silu_times(gate, up), mask=mask)
