"""For `lt_algos.py` (an experiment, not used by the engine): matrix products through cuBLASLt
with an algorithm chosen by timing, not by its heuristic.

`F.linear` runs the first algorithm cuBLASLt's heuristic proposes. For the decode step's
products (a few hundred rows against 1-55 MB of weights) that first guess can leave SMs idle
for most of a second wave of tiles; cuBLASLt proposes others (other tiles, split-k counts),
and one of them may finish sooner. `LtLinear` asks for the candidates of one product shape,
times each inside a CUDA graph on weights too large for L2 (as the step streams them), keeps the
fastest, and from then on runs that one: capturable in CUDA graphs, deterministic for a fixed
algorithm (cuBLASLt's results depend on the algorithm, its reductions never on timing).

ctypes only, through the library torch itself loaded; half-precision operands, float32
accumulation, optional bias, as `F.linear` computes them.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("rlfleet.rollout")

_COMPUTE_32F = 68
_DATA_TYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_OP_N, _OP_T = 0, 1
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE = 1
_CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                 "inner": 7, "cluster": 8}
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_lib = None


def _library():
    global _lib
    if _lib is None:
        major = (torch.version.cuda or "12").split(".")[0]
        for name in (f"libcublasLt.so.{major}", "libcublasLt.so"):
            try:
                _lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            import nvidia.cublas  # the wheel torch depends on

            path = next(iter(nvidia.cublas.__path__))
            _lib = ctypes.CDLL(f"{path}/lib/libcublasLt.so.{major}")
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@dataclass
class Candidate:
    index: int  # its place in the heuristic's list (0: what F.linear runs)
    algo: _Algo
    workspace: int
    waves: float
    config: dict[str, int]


class LtLinear:
    """x [rows, k] @ weight [n, k].T (+ bias [n]) -> [rows, n], for one (rows, n, k, dtype, bias)."""

    _handle = None
    _workspaces: dict[torch.device, torch.Tensor] = {}

    def __init__(self, rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, device: torch.device):
        lib = _library()
        if LtLinear._handle is None:
            handle = ctypes.c_void_p()
            _check(lib.cublasLtCreate(ctypes.byref(handle)), "create")
            LtLinear._handle = handle
        self.rows, self.n, self.k, self.dtype, self.bias, self.device = rows, n, k, dtype, bias, device
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, 0), "matmul desc")
        self._set(_DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set(_DESC_TRANSB, ctypes.c_int32(_OP_N))
        self._set(_DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_BIAS if bias else _EPILOGUE_DEFAULT))
        # Column-major, as cuBLAS sees row-major tensors: out^T [n, rows] = weight [k, n]^T @ x^T [k, rows].
        kind = _DATA_TYPES[dtype]
        self.a, self.b, self.c = (self._layout(kind, k, n, k), self._layout(kind, k, rows, k),
                                  self._layout(kind, n, rows, n))
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.chosen: Candidate | None = None

    def _set(self, attr: int, value) -> None:
        _check(_library().cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
               f"desc attribute {attr}")

    @staticmethod
    def _layout(kind: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(_library().cublasLtMatrixLayoutCreate(ctypes.byref(layout), kind, ctypes.c_uint64(rows),
                                                      ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return layout

    def candidates(self, count: int = 32) -> list[Candidate]:
        lib = _library()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(size),
                                                        ctypes.sizeof(size)), "preference workspace")
        results = (_Heuristic * count)()
        found = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(LtLinear._handle, self.desc, self.a, self.b, self.c, self.c, pref,
                                                  count, results, ctypes.byref(found)), "heuristic")
        lib.cublasLtMatmulPreferenceDestroy(pref)
        out = []
        for i in range(found.value):
            if results[i].state != 0:
                continue
            config = {}
            for name, attr in _CONFIG_ATTRS.items():
                algo, value, size = ctypes.byref(results[i].algo), ctypes.c_uint64(0), ctypes.c_size_t(0)
                if (lib.cublasLtMatmulAlgoConfigGetAttribute(algo, attr, None, 0, ctypes.byref(size)) == 0
                        and 0 < size.value <= 8
                        and lib.cublasLtMatmulAlgoConfigGetAttribute(algo, attr, ctypes.byref(value), size.value,
                                                                     ctypes.byref(size)) == 0):
                    config[name] = int(value.value)
            out.append(Candidate(i, results[i].algo, int(results[i].workspace_size), float(results[i].waves), config))
        return out

    def _workspace(self) -> torch.Tensor:
        ws = LtLinear._workspaces.get(self.device)
        if ws is None:
            ws = LtLinear._workspaces[self.device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                 device=self.device)
        return ws

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            candidate: Candidate | None = None) -> torch.Tensor:
        candidate = candidate or self.chosen
        assert candidate is not None, "LtLinear.run: no algorithm chosen"
        assert x.shape == (self.rows, self.k) and weight.shape == (self.n, self.k) and x.stride(1) == 1
        if self.bias:
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        ws = self._workspace()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _check(_library().cublasLtMatmul(
            LtLinear._handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(weight.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()), self.c,
            ctypes.c_void_p(out.data_ptr()), self.c, ctypes.byref(candidate.algo), ctypes.c_void_p(ws.data_ptr()),
            ctypes.c_size_t(WORKSPACE_BYTES),
            ctypes.c_void_p(stream)), "matmul")
        return out
