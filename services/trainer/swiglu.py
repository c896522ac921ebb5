"""SwiGLU over Megatron's fused fc1 output, `[..., gate | up]`, as one custom op with a hand-written backward.

Megatron's MLP splits its fused `linear_fc1` output in two halves and computes `silu(gate) * up`.
Compiled, the backward of that split is a `cat` of the two gradients, which Inductor turns into a
kernel that moves twice the bytes the maths needs: 20 ms of a 1.5B train step on an H200, against
9.5 ms for the same SwiGLU on separate gate and up tensors (the torch backend's layout). On CUDA
this op runs two Triton kernels that read each half where it lies and write the fused gradient in
place (`[dgate | dup]` per row), computing in float32 and rounding once, as Inductor's fused kernel
does. On the CPU it is Megatron's own expression, `silu(gate) * up` in the model's dtype.

`FusedSwiGLU` plugs it into Megatron's MLP through the layer spec (`use_te_activation_func` with
`MLPSubmodules.activation_func`), the hook Megatron offers for an activation module of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BLOCK = 1024  # columns per Triton program


_kernels = None


def _triton_kernels():
    """Compiled on first use: triton exists only where CUDA does."""
    global _kernels
    if _kernels is None:
        import triton
        import triton.language as tl

        @triton.jit
        def forward(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask).to(tl.float32)
            up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask).to(tl.float32)
            out = gate * tl.sigmoid(gate) * up
            tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

        @triton.jit
        def backward(x_ptr, grad_ptr, dx_ptr, n_cols, BLOCK: tl.constexpr):
            row = tl.program_id(0).to(tl.int64)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            gate = tl.load(x_ptr + row * 2 * n_cols + cols, mask=mask).to(tl.float32)
            up = tl.load(x_ptr + row * 2 * n_cols + n_cols + cols, mask=mask).to(tl.float32)
            g = tl.load(grad_ptr + row * n_cols + cols, mask=mask).to(tl.float32)
            sig = tl.sigmoid(gate)
            dgate = g * up * sig * (1 + gate * (1 - sig))
            dup = g * gate * sig
            tl.store(dx_ptr + row * 2 * n_cols + cols, dgate.to(dx_ptr.dtype.element_ty), mask=mask)
            tl.store(dx_ptr + row * 2 * n_cols + n_cols + cols, dup.to(dx_ptr.dtype.element_ty), mask=mask)

        _kernels = (forward, backward)
    return _kernels


def _grid(rows: int, n_cols: int) -> tuple[int, int]:
    return rows, -(-n_cols // _BLOCK)


@torch.library.custom_op("rlfleet::swiglu_fused", mutates_args=(), device_types="cuda")
def swiglu_fused(fused: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `fused` = [..., 2 * I] laid out as [gate | up]; returns [..., I]."""
    fused = fused.contiguous()
    n_cols = fused.shape[-1] // 2
    out = fused.new_empty(*fused.shape[:-1], n_cols)
    rows = fused.numel() // (2 * n_cols)
    if rows:
        _triton_kernels()[0][_grid(rows, n_cols)](fused, out, n_cols, BLOCK=_BLOCK)
    return out


@swiglu_fused.register_fake
def _(fused: torch.Tensor) -> torch.Tensor:
    return fused.new_empty(*fused.shape[:-1], fused.shape[-1] // 2)


@torch.library.custom_op("rlfleet::swiglu_fused_backward", mutates_args=(), device_types="cuda")
def swiglu_fused_backward(fused: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of `swiglu_fused` at `fused` for output gradient `grad`, as [..., dgate | dup]."""
    fused, grad = fused.contiguous(), grad.contiguous()
    n_cols = fused.shape[-1] // 2
    dx = torch.empty_like(fused)
    rows = fused.numel() // (2 * n_cols)
    if rows:
        _triton_kernels()[1][_grid(rows, n_cols)](fused, grad, dx, n_cols, BLOCK=_BLOCK)
    return dx


@swiglu_fused_backward.register_fake
def _(fused: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(fused)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    (fused,) = ctx.saved_tensors
    return swiglu_fused_backward(fused, grad)


swiglu_fused.register_autograd(_backward, setup_context=_setup_context)


class FusedSwiGLU(torch.nn.Module):
    """Megatron's MLP activation slot (`MLPSubmodules.activation_func`): SwiGLU of the fused fc1 output."""

    def __init__(self, config=None) -> None:
        super().__init__()

    def forward(self, fused: torch.Tensor) -> torch.Tensor:  # [S, B, 2 * I/tp] -> [S, B, I/tp]
        if fused.device.type == "cuda":
            return swiglu_fused(fused)
        gate, up = fused.chunk(2, dim=-1)  # Megatron's own expression (and the torch backend's)
        return F.silu(gate) * up
