"""For `lt_algos.py` (session 19's experiment): matrix products through cuBLASLt on any of its
candidate algorithms, whatever their bits, with each candidate's whole configuration to print.

The binding itself is the engine's (`services/rollout/builtin/cublaslt.py`, which takes only
candidates that give F.linear's bits); this adds what the screen prints and the experiment's
larger workspace (32 MB: session 19 listed the candidates that need up to that much).
"""

from __future__ import annotations

import torch

from services.rollout.builtin import cublaslt
from services.rollout.builtin.cublaslt import Candidate, LtProduct

_CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                 "inner": 7, "cluster": 8}
cublaslt.WORKSPACE_BYTES = 32 << 20


class LtLinear(LtProduct):
    """x [rows, k] (contiguous) @ weight [n, k].T (+ bias [n]) -> [rows, n], for one (rows, n, k, dtype, bias)."""

    def __init__(self, rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, device: torch.device):
        super().__init__(rows, n, k, k, dtype, bias, device)

    def candidates(self, count: int = 32) -> list[Candidate]:
        found = super().candidates(count)
        for candidate in found:
            candidate.config = {name: self.config(candidate.algo, attr) for name, attr in _CONFIG_ATTRS.items()}
        return found
