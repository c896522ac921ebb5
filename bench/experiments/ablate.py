"""A one-off experiment (2026-12-02): where the decode step's time goes on its critical path. Each
variant takes one piece out of the step (its kernel is not launched; what it would have returned
is an unwritten tensor of the right shape, or its input), so (full step - step without it) is what
that piece costs the step, launches and the waits around it included, which per-kernel profiles
cannot show once kernels overlap (programmatic dependent launch). Outputs are garbage in every
variant but "full"; only the times mean anything.

    python bench/experiments/ablate.py "full,-attention,..." 16,256 [0.5b,1.5b]   # on a GPU
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.alternate import alternate, cli  # noqa: E402
from bench.rollout import VOCAB  # noqa: E402
from services.rollout.builtin import forward  # noqa: E402

VARIANTS = ("full", "-attention", "-qkv", "-o", "-gate_up", "-silu", "-down", "-norms", "-lm_head")


def _blank(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows, cols, dtype=like.dtype, device=like.device)  # no kernel


def apply(core, name: str) -> None:
    ops = core.ops
    for attr in ("rope_decode_attention", "linear", "silu_mul_linear", "add_rmsnorm"):
        ops.__dict__.pop(attr, None)  # back to the class's methods
    forward.F = F
    cls = type(ops)
    hidden = core.model.config.hidden_size
    if name == "-attention":
        ops.rope_decode_attention = lambda q, *rest: q
    elif name in ("-qkv", "-o", "-gate_up"):
        def linear(x, weight, bias=None, _name=name):
            n, k = weight.shape
            skip = {"-qkv": k == hidden and n != hidden and n < 2 * hidden, "-o": n == k,
                    "-gate_up": k == hidden and n >= 2 * hidden}[_name]
            return _blank(x.shape[0], n, x) if skip else cls.linear(ops, x, weight, bias)
        ops.linear = linear
    elif name == "-silu":
        ops.silu_mul_linear = lambda gate, up, weight, bias=None: ops.linear(gate, weight, bias)
    elif name == "-down":
        ops.silu_mul_linear = lambda gate, up, weight, bias=None: _blank(gate.shape[0], weight.shape[0], gate)
    elif name == "-norms":
        ops.add_rmsnorm = lambda x, residual, weight, eps: (x, x)
    elif name == "-lm_head":
        shim = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("_")})
        shim.linear = lambda x, w, b=None: _blank(x.shape[0], w.shape[0], x) if w.shape[0] == VOCAB else F.linear(x, w, b)
        forward.F = shim


def main() -> None:
    names, batches = cli(dict.fromkeys(VARIANTS), [16, 256])
    shapes = tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else ("0.5b",)
    alternate(names, batches, apply, shapes=shapes)


if __name__ == "__main__":
    main()
