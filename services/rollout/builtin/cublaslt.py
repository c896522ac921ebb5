"""The engine's large cuBLAS products on a faster cuBLASLt algorithm that gives F.linear's bits.

`F.linear` runs the first algorithm cuBLASLt's heuristic proposes. For the decode step's large
products (the MLP's and the output embedding, a few hundred rows against 9-300 MB of weights)
and a captured prefill's, another of its candidates can finish sooner: at 0.5B, 256 rows, the
gate/up product took 9.8 against 10.9 us, measured on an H200. A choice made by timing differs
between runs and machines, so it is made only among candidates whose output equals F.linear's
to the bit (checked on the call's own inputs and on random ones): whichever wins, every
product, and so every token and logprob, is what F.linear gives, and a seed keeps giving the
same samples after a restart. Candidates that split k differently (other sums) fail that check
and are never taken. (Candidates with other bits, and configurations beyond the heuristic's
list, were measured too: docs/design/engine-tuning.md.)

`choose` tunes one product shape: it times F.linear and every eligible candidate inside a CUDA
graph, on copies of the weight together larger than L2 (as the step streams its weights), and
keeps the fastest if it beats F.linear by `min_gain`. ctypes only, through the cuBLASLt library
torch itself loads; half-precision operands, float32 accumulation, optional bias. GPU only.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger("rlfleet.rollout")

_COMPUTE_32F = 68
_DATA_TYPES = {torch.float16: 2, torch.bfloat16: 14}
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_OP_N, _OP_T = 0, 1
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE = 1
_CONFIG_TILE, _CONFIG_SPLITK = 1, 2
WORKSPACE_BYTES = 4 << 20  # per device; candidates that need more are not asked for
TIMED_BYTES = 96 << 20  # weight copies timed together: past the H200's 50 MB L2
TIMED_US = 1500.0  # products per timing: about this long, 3-20 of them


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_lib = None
_handle = None
_workspaces: dict[torch.device, torch.Tensor] = {}


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

            _lib = ctypes.CDLL(f"{next(iter(nvidia.cublas.__path__))}/lib/libcublasLt.so.{major}")
    return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


@dataclass
class Candidate:
    index: int  # its place in the heuristic's list
    algo: _Algo
    workspace: int
    waves: float  # the heuristic's estimate of how many waves of the GPU's SMs it runs
    tile: int
    splitk: int


class LtProduct:
    """out [rows, n] = x [rows, k] (row stride ld) @ weight [n, k].T (+ bias [n]), for one shape."""

    def __init__(self, rows: int, n: int, k: int, ld: int, dtype: torch.dtype, bias: bool, device: torch.device):
        global _handle
        lib = _library()
        if _handle is None:
            handle = ctypes.c_void_p()
            _check(lib.cublasLtCreate(ctypes.byref(handle)), "create")
            _handle = handle
        self.rows, self.n, self.k, self.ld, self.dtype, self.bias, self.device = rows, n, k, ld, dtype, bias, device
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, 0), "matmul desc")
        self._set(_DESC_TRANSA, ctypes.c_int32(_OP_T))
        self._set(_DESC_TRANSB, ctypes.c_int32(_OP_N))
        self._set(_DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_BIAS if bias else _EPILOGUE_DEFAULT))
        # Column-major, as cuBLAS sees row-major tensors: out^T [n, rows] = weight [k, n]^T @ x^T [k, rows].
        kind = _DATA_TYPES[dtype]
        self.a, self.b, self.c = self._layout(kind, k, n, k), self._layout(kind, k, rows, ld), self._layout(kind, n,
                                                                                                         rows, n)
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

    def candidates(self, count: int = 16) -> list[Candidate]:
        """What cuBLASLt's heuristic proposes for this shape, in its order."""
        lib = _library()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        size = ctypes.c_uint64(WORKSPACE_BYTES)
        try:
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE, ctypes.byref(size),
                                                            ctypes.sizeof(size)), "preference workspace")
            results = (_Heuristic * count)()
            found = ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle, self.desc, self.a, self.b, self.c, self.c, pref, count,
                                                      results, ctypes.byref(found)), "heuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [Candidate(i, results[i].algo, int(results[i].workspace_size), float(results[i].waves),
                          self.config(results[i].algo, _CONFIG_TILE), self.config(results[i].algo, _CONFIG_SPLITK))
                for i in range(found.value) if results[i].state == 0]

    @staticmethod
    def config(algo: _Algo, attr: int) -> int:
        """An algorithm's configuration attribute `attr` (cublasLtMatmulAlgoConfigAttributes_t), -1 if unreadable."""
        value, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        lib = _library()
        if (lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(size)) == 0
                and 0 < size.value <= 8
                and lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), size.value,
                                                             ctypes.byref(size)) == 0):
            return int(value.value)
        return -1

    def run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            candidate: Candidate | None = None) -> torch.Tensor:
        """The product on `candidate` (default: the chosen one), into a new tensor; capturable."""
        candidate = candidate or self.chosen
        assert candidate is not None and x.shape == (self.rows, self.k) and x.stride() == (self.ld, 1)
        assert weight.shape == (self.n, self.k) and weight.is_contiguous() and (bias is not None) == self.bias
        out = torch.empty(self.rows, self.n, dtype=x.dtype, device=x.device)
        if bias is not None:
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        workspace = _workspace(self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _check(_library().cublasLtMatmul(
            _handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(weight.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()), self.c,
            ctypes.c_void_p(out.data_ptr()), self.c, ctypes.byref(candidate.algo), ctypes.c_void_p(workspace.data_ptr()),
            ctypes.c_size_t(WORKSPACE_BYTES), ctypes.c_void_p(stream)), "matmul")
        return out


def _workspace(device: torch.device) -> torch.Tensor:
    workspace = _workspaces.get(device)
    if workspace is None:
        workspace = _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return workspace


def graph_us(fn, calls: int) -> float:
    """Microseconds a call of fn(i), i = 0..calls-1, run back to back in a CUDA graph (median of 5)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[2]


def choose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
           min_gain: float) -> LtProduct | None:
    """An `LtProduct` for x's shape on the fastest candidate that gives F.linear's bits, or None
    when none beats F.linear by `min_gain` (a fraction of its time). Runs products on the
    current device: never while a graph is being captured."""
    started = time.perf_counter()
    rows, k = x.shape
    n = weight.shape[0]
    product = LtProduct(rows, n, k, x.stride(0), x.dtype, bias is not None, x.device)
    generator = torch.Generator(device=x.device).manual_seed(0)
    probe = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)  # x's row stride too
    probe.copy_(torch.randn(x.shape, generator=generator, device=x.device))
    probes = [x, probe]
    wanted = [F.linear(p, weight, bias) for p in probes]
    same = []
    for candidate in product.candidates():
        try:
            outs = [product.run(p, weight, bias, candidate) for p in probes]
        except RuntimeError:  # a candidate this shape cannot run after all
            continue
        if all(torch.equal(o, w) for o, w in zip(outs, wanted)) and torch.equal(product.run(x, weight, bias, candidate),
                                                                                 wanted[0]):
            same.append(candidate)
    if not same:
        return None
    copies = weight.expand(max(1, -(-TIMED_BYTES // (weight.numel() * weight.element_size()))), n, k).contiguous()
    default_us = graph_us(lambda i: F.linear(x, copies[i % len(copies)], bias), 3)
    calls = max(3, min(20, int(TIMED_US / max(default_us, 1.0))))
    default_us = graph_us(lambda i: F.linear(x, copies[i % len(copies)], bias), calls)
    timed = sorted((graph_us(lambda i, c=c: product.run(x, copies[i % len(copies)], bias, c), calls), c.index, c)
                   for c in same)
    best_us, _, best = timed[0]
    shape = f"{rows} x {n} x {k}{' + bias' if bias is not None else ''}"
    spent = (time.perf_counter() - started) * 1e3
    if best_us > default_us * (1 - min_gain):
        log.info("cuBLASLt %s: F.linear kept (%.1f us; the fastest of %d candidates with its bits %.1f); tuned in "
                 "%.0f ms", shape, default_us, len(same), best_us, spent)
        return None
    product.chosen = best
    log.info("cuBLASLt %s: candidate #%d (tile %d, split-k %d), %.1f against F.linear's %.1f us; tuned in %.0f ms",
             shape, best.index, best.tile, best.splitk, best_us, default_us, spent)
    return product
