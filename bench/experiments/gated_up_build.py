"""Builds and loads `gated_up.cu` for the experiment `gated_up.py` (session 25): nvcc for sm_90a
into a cache directory (`RLFLEET_KERNEL_CACHE`, default `~/.cache/rlfleet/kernels`, one file per
source text and flags), called through ctypes. The kernel is not in the engine: in the decode
step it lost to cuBLAS and the SiLU kernel (`bench/results/gated_up-experiment-*`)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("rlfleet.rollout")

SOURCE = Path(__file__).resolve().parent / "gated_up.cu"
FLAGS = ("-O3", "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC")
# Compiled variants of the gated product, (tokens, stages): up to `tokens` rows, that many tiles
# of k in flight (`rlf_gated_up`). A program takes 64 gate and 64 up rows of the weight.
VARIANTS = {256: 4, 128: 6, 64: 8}
WEIGHT_ROWS = 64

_lock = threading.Lock()
_library: GatedUpLibrary | None = None
_failure: str | None = None


class KernelError(RuntimeError):
    """A CUDA C kernel refused its arguments or failed to launch."""


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and Path(home, "bin", "nvcc").is_file():
            return str(Path(home, "bin", "nvcc"))
    return None


def _build(source: Path, nvcc: str) -> Path:
    """The shared library for `source`, compiled once per source text and flags (atomically:
    concurrent processes each build to a temporary name and the last rename wins)."""
    text = source.read_bytes()
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("RLFLEET_KERNEL_CACHE", Path.home() / ".cache" / "rlfleet" / "kernels"))
    target = cache / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        done = subprocess.run([nvcc, *FLAGS, "-o", str(built), str(source), "-ldl"], capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed on {source.name}: {done.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


class GatedUpLibrary:
    """`gated_up.cu`, built and loaded."""

    def __init__(self, path: Path):
        self._lib = ctypes.CDLL(str(path))
        self._lib.rlf_gated_up.restype = ctypes.c_int
        self._lib.rlf_gated_up.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5 + [ctypes.c_void_p] + \
            [ctypes.c_int] * 4 + [ctypes.c_void_p]
        self._lib.rlf_error_string.restype = ctypes.c_char_p
        self._lib.rlf_error_string.argtypes = [ctypes.c_int]

    def gated_up(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, *, tokens: int, cluster: int,
                 pdl: bool, trace: torch.Tensor | None = None) -> torch.Tensor:
        """out [M, I] = silu(x @ gate.T) * (x @ up.T) for x [M <= tokens, K] and weight [2 I, K]
        (gate rows, then up rows), bf16, on the current stream; `cluster` programs share x."""
        rows, k = x.shape
        inter = weight.shape[0] // 2
        if not (x.dtype == weight.dtype == out.dtype == torch.bfloat16 and x.stride(1) == 1
                and weight.is_contiguous() and out.stride(1) == 1 and weight.shape[1] == k
                and out.shape == (rows, inter)):
            raise KernelError(f"gated_up: wants bf16 x [M, K], weight [2 I, K] and out [M, I]; got x {tuple(x.shape)} "
                              f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}, out {tuple(out.shape)}")
        code = self._lib.rlf_gated_up(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, k, inter, x.stride(0),
                                      out.stride(0), torch.cuda.current_stream(x.device).cuda_stream, tokens,
                                      VARIANTS.get(tokens, 0), cluster, int(pdl),
                                      None if trace is None else trace.data_ptr())
        if code != 0:
            raise KernelError(f"gated_up ({rows} x {k} -> {inter}, {tokens} tokens, cluster {cluster}): "
                              f"{self._lib.rlf_error_string(code).decode()}")
        return out


def gated_up_library() -> GatedUpLibrary | None:
    """The built library, or None where it cannot be had here (the reason logged once)."""
    global _library, _failure
    with _lock:
        if _library is not None or _failure is not None:
            return _library
        try:
            if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
                raise RuntimeError("needs a Hopper GPU (compute capability 9.x)")
            nvcc = _nvcc()
            if nvcc is None:
                raise RuntimeError("no nvcc (set CUDA_HOME or put it on PATH)")
            _library = GatedUpLibrary(_build(SOURCE, nvcc))
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            _failure = str(exc)
            log.warning("gated_up.cu not built (%s)", _failure)
        return _library
