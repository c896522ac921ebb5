"""Experiment (2026-12-03, session 24): cuBLASLt configurations beyond the heuristic's list.

The engine takes the fastest of the candidates cuBLASLt's heuristic lists (8 for these shapes)
that give F.linear's bits (`services/rollout/builtin/cublaslt.py`). An algorithm's configuration
(tile, stages, cluster shape, custom option, CTA swizzle) can also be set by hand and vetted by
cublasLtMatmulAlgoCheck. This screen makes variants of every listed candidate, one attribute
changed at a time and then once more from the three fastest, keeps those AlgoCheck accepts, checks
their bits against F.linear (same bits: the engine could take them without changing a token) and
times each alone, as the engine's tuning does (a CUDA graph of products on weight copies past L2).

    python bench/experiments/lt_variants.py 0.5b-decode 0.5b-prefill 1.5b-decode

Prints, per product: F.linear, the engine's current choice (the heuristic's fastest with F.linear's
bits), the fastest variant with F.linear's bits and the fastest with any bits, each with its
configuration.
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.experiments.cublaslt import _CONFIG_ATTRS, LtLinear  # noqa: E402
from services.rollout.builtin import cublaslt  # noqa: E402
from services.rollout.builtin.cublaslt import Candidate, _Algo, _Heuristic, _library  # noqa: E402

GROUPS = {  # name: [(product, rows, n, k, bias)]
    "0.5b-decode": [("gate_up", 256, 9728, 896, False), ("down", 256, 896, 4864, False),
                    ("lm_head", 256, 151936, 896, False)],
    "0.5b-prefill": [("qkv", 16384, 1152, 896, True), ("o", 16384, 896, 896, False),
                     ("gate_up", 16384, 9728, 896, False), ("down", 16384, 896, 4864, False)],
    "1.5b-decode": [("gate_up", 256, 17920, 1536, False), ("down", 256, 1536, 8960, False),
                    ("lm_head", 256, 151936, 1536, False)],
}
_CAP_SPLITK, _CAP_SWIZZLE, _CAP_TILE_IDS, _CAP_CUSTOM_MAX, _CAP_STAGES_IDS = 0, 2, 6, 7, 13
VARIED = ("cluster", "custom", "swizzle", "stages", "tile")  # few values first: the budget may end in the tiles
MAX_TIMED = 300  # variants timed per product at most (beyond the heuristic's)


def _cap_list(algo: _Algo, attr: int) -> list[int]:
    lib, size = _library(), ctypes.c_size_t(0)
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(size)) != 0 or not size.value:
        return []
    buf = (ctypes.c_uint32 * (size.value // 4))()
    if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, buf, size.value, ctypes.byref(size)) != 0:
        return []
    return list(buf)


def _cap_int(algo: _Algo, attr: int) -> int:
    value, size = ctypes.c_int32(0), ctypes.c_size_t(0)
    ok = _library().cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4,
                                                     ctypes.byref(size))
    return value.value if ok == 0 else 0


def _with(algo: _Algo, attr: int, value: int) -> _Algo | None:
    """A copy of algo with config attribute attr set to value (None if it cannot be set)."""
    lib, size = _library(), ctypes.c_size_t(0)
    new = _Algo()
    new.data[:] = algo.data[:]
    if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(new), attr, None, 0, ctypes.byref(size)) != 0:
        return None
    kind = {1: ctypes.c_uint8, 2: ctypes.c_uint16, 4: ctypes.c_uint32, 8: ctypes.c_uint64}.get(size.value)
    if kind is None:
        return None
    v = kind(value)
    if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(new), attr, ctypes.byref(v), size.value) != 0:
        return None
    return new


def _checked(lt: LtLinear, algo: _Algo) -> Candidate | None:
    result = _Heuristic()
    status = _library().cublasLtMatmulAlgoCheck(cublaslt._handle, lt.desc, lt.a, lt.b, lt.c, lt.c, ctypes.byref(algo),
                                               ctypes.byref(result))
    if status != 0 or result.state != 0 or result.workspace_size > cublaslt.WORKSPACE_BYTES:
        return None
    c = Candidate(-1, algo, int(result.workspace_size), float(result.waves), lt.config(algo, 1), lt.config(algo, 2))
    c.config = {name: lt.config(algo, attr) for name, attr in _CONFIG_ATTRS.items()}
    return c


def _key(c: Candidate) -> tuple:
    return tuple(sorted(c.config.items()))


def _neighbours(lt: LtLinear, base: Candidate) -> list[Candidate]:
    values = {
        "tile": _cap_list(base.algo, _CAP_TILE_IDS),
        "stages": _cap_list(base.algo, _CAP_STAGES_IDS),
        "cluster": list(range(0, 24)),
        "custom": list(range(0, _cap_int(base.algo, _CAP_CUSTOM_MAX) + 1)),
        "swizzle": [0, 1] if _cap_int(base.algo, _CAP_SWIZZLE) else [],
    }
    found = []
    for name in VARIED:
        for value in values[name]:
            if value == base.config.get(name):
                continue
            algo = _with(base.algo, _CONFIG_ATTRS[name], value)
            c = _checked(lt, algo) if algo is not None else None
            if c is not None:
                found.append(c)
    return found


def screen(product: str, rows: int, n: int, k: int, has_bias: bool, gen: torch.Generator) -> None:
    started = time.perf_counter()
    copies = max(1, -(-cublaslt.TIMED_BYTES // (n * k * 2)))
    weight = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    weights = weight.expand(copies, n, k).contiguous()
    bias = (torch.randn(n, generator=gen, device="cuda") * 0.02).to(torch.bfloat16) if has_bias else None
    x = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
    probe = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
    lt = LtLinear(rows, n, k, torch.bfloat16, has_bias, x.device)
    wanted = [F.linear(p, weight, bias) for p in (x, probe)]
    default_us = cublaslt.graph_us(lambda i: F.linear(x, weights[i % copies], bias), 3)
    calls = max(3, min(20, int(cublaslt.TIMED_US / max(default_us, 1.0))))
    default_us = cublaslt.graph_us(lambda i: F.linear(x, weights[i % copies], bias), calls)

    def run(c: Candidate) -> tuple[float, bool] | None:
        try:
            outs = [lt.run(p, weight, bias, c) for p in (x, probe)]
            torch.cuda.synchronize()
            same = all(torch.equal(o, w) for o, w in zip(outs, wanted))
            return cublaslt.graph_us(lambda i: lt.run(x, weights[i % copies], bias, c), calls), same
        except RuntimeError as exc:
            print(f"   failed {c.config}: {exc}", flush=True)
            return None

    listed = lt.candidates(32)
    timed: dict[tuple, tuple[float, bool, Candidate, str]] = {}
    for c in listed:
        r = run(c)
        if r:
            timed[_key(c)] = (r[0], r[1], c, f"listed #{c.index}")
    current = min((t for t in timed.values() if t[1]), default=None, key=lambda t: t[0])
    tried = 0
    frontier = [t[2] for t in sorted(timed.values(), key=lambda t: t[0])[:3]]
    for depth in range(2):  # half the budget around the fastest listed, half around the fastest variants
        new = []
        per_base = MAX_TIMED // 2 // max(1, len(frontier))
        for base in frontier:
            spent = 0
            for c in _neighbours(lt, base):
                if _key(c) in timed or spent >= per_base:
                    continue
                spent += 1
                r = run(c)
                if r:
                    timed[_key(c)] = (r[0], r[1], c, f"depth {depth} from {base.config}")
                    new.append(c)
            tried += spent
        frontier = [t[2] for t in sorted((timed[_key(c)] for c in new), key=lambda t: t[0])[:3]]
    ranked = sorted(timed.values(), key=lambda t: t[0])
    same = [t for t in ranked if t[1]]
    flops = 2 * rows * n * k
    print(f"{product:8s} {rows}x{n}x{k}{'+bias' if has_bias else ''}: F.linear {default_us:.1f} us "
          f"({flops / default_us / 1e6:.0f} TFLOP/s); current choice "
          f"{'%.1f' % current[0] if current and current[0] < default_us * 0.97 else 'F.linear'}; "
          f"{len(listed)} listed, {tried} variants timed, {len(same)} of {len(ranked)} with F.linear's bits; "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    for us, bits, c, origin in same[:4]:
        print(f"   same bits {us:7.1f} us {c.config} waves {c.waves:.2f} ({origin})", flush=True)
    for us, bits, c, origin in [t for t in ranked if not t[1]][:2]:
        print(f"   other bits {us:7.1f} us {c.config} waves {c.waves:.2f} ({origin})", flush=True)


def main(argv: list[str]) -> None:
    cublaslt.WORKSPACE_BYTES = 32 << 20
    gen = torch.Generator(device="cuda").manual_seed(0)
    for group in argv or list(GROUPS):
        print(f"# {group}", flush=True)
        for spec in GROUPS[group]:
            screen(*spec, gen=gen)


if __name__ == "__main__":
    main(sys.argv[1:])
