"""Experiment (2026-12-03, session 27): cuBLAS's kernels in the captured graphs on programmatic
edges, so that each starts while the kernel before it still runs, as the Triton kernels do.

Why: the Triton kernels are launched with PDL, but cuBLAS launches its own kernels, so in the
captured graph every edge into a cuBLAS kernel is an ordinary one: the kernel before it drains,
its memory is flushed, and only then are the product's CTAs sent out and set up (barriers, TMA
descriptors) before its first load. At 256 rows the step has 3 of those a layer (gate/up, down,
down's split-k reduce) and the output embedding's, 73 a step. A graph's edges can be changed
after capture (`torch.cuda.CUDAGraph(keep_graph=True)`, then the driver's cuGraph*Dependencies_v2)
before it is instantiated.

That is only correct if the kernel waits (griddepcontrol.wait) before it reads what the kernel
before it wrote. cuBLAS's nvjet kernels are generated at run time (their names are printf formats
in libcublasLt), so their machine code cannot be read from the library. `probe` tests it: a
Triton kernel that lets its dependents launch at once, spins for 50 us and then writes x, and the
product of x behind it on a programmatic edge. A product that does not wait reads x before it is
written, and its output is wrong.

    python bench/experiments/pdl_edges.py probe             # on a GPU
    python bench/experiments/pdl_edges.py step [variants] [batches]

The probe's answer (H200, torch 2.11+cu130): they do not wait. Every gate/up and down product
read x before it was written (0/20 replays right; the output embedding's kernel got no such
edge, its predecessor being a copy). So variant `late` instead keeps cuBLAS's kernels as they
are and moves the wait into the kernel before each: the norm before gate/up and the output
embedding, and the SiLU before down, let their dependents launch only after their last store,
a fence and a barrier (`_then_library` kernels), and only edges from those kernels into cuBLAS
kernels become programmatic. The product then starts when the last program of the kernel before
it has stored its output, not after that kernel has drained and been flushed.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.rollout.builtin.pointwise_kernels import _silu_times  # noqa: E402

KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, and CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
LIBRARY_MARKS = ("nvjet", "cublas", "gemm", "cutlass", "splitkreduce")


class EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


_cuda = None


def cuda():
    global _cuda
    if _cuda is None:
        _cuda = ctypes.CDLL("libcuda.so.1")
    return _cuda


def check(status: int, what: str) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        cuda().cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{what}: {name.value.decode() if name.value else status}")


def kernel_name(node) -> str | None:
    kind = ctypes.c_int()
    check(cuda().cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
    if kind.value != KERNEL_NODE:
        return None
    params = KernelParams()
    check(cuda().cuGraphKernelNodeGetParams_v2(node, ctypes.byref(params)), "cuGraphKernelNodeGetParams")
    name = ctypes.c_char_p()
    if params.func:
        check(cuda().cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)), "cuFuncGetName")
    elif params.kern:
        check(cuda().cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)), "cuKernelGetName")
    return name.value.decode() if name.value else "?"


def edges(graph) -> list[tuple[int, int, EdgeData]]:
    count = ctypes.c_size_t()
    check(cuda().cuGraphGetEdges_v2(graph, None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (EdgeData * n)()
    check(cuda().cuGraphGetEdges_v2(graph, src, dst, data, ctypes.byref(count)), "cuGraphGetEdges")
    return [(src[i], dst[i], data[i]) for i in range(n)]


def is_library(name: str | None) -> bool:
    return name is not None and any(mark in name.lower() for mark in LIBRARY_MARKS)


@triton.jit
def _fence_and_trigger():
    """Every thread's stores visible GPU-wide, every thread past that, then dependents may launch."""
    tl.inline_asm_elementwise("membar.gl; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _add_rmsnorm_then_library_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, stride_x, stride_res,
                                     stride_out, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """`_add_rmsnorm_kernel`, its dependents launched after its stores."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    tl.store(res_out_ptr + row * stride_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(x.dtype), mask=mask)
    _fence_and_trigger()


@triton.jit
def _silu_mul_then_library_kernel(gate_ptr, up_ptr, out_ptr, n_cols, stride_gate, stride_up, BLOCK: tl.constexpr):
    """`_silu_mul_kernel`, its dependents launched after its stores."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    tl.extra.cuda.gdc_wait()
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, _silu_times(gate, up), mask=mask)
    _fence_and_trigger()


def late_ops(ops) -> None:
    """ops.add_rmsnorm and ops.silu_mul on the `_then_library` kernels where a cuBLAS product
    follows: the norm after attention and the last one (a forward makes 2 a layer and a last),
    and every SiLU (a small batch's down product with its SiLU inside never calls it)."""
    cls = type(ops)
    calls = [0]
    layers_x2_plus_1 = [None]

    def add_rmsnorm(x, residual, weight, eps):
        index = calls[0]
        calls[0] = (calls[0] + 1) % layers_x2_plus_1[0]
        if index % 2 == 0 and index != layers_x2_plus_1[0] - 1:
            return cls.add_rmsnorm(ops, x, residual, weight, eps)
        rows, cols = x.shape
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        has_res = residual is not None
        _add_rmsnorm_then_library_kernel[(rows,)](
            x, residual if has_res else x, weight, out, res_out, cols, x.stride(0),
            residual.stride(0) if has_res else 0, out.stride(0), eps, HAS_RESIDUAL=has_res,
            BLOCK=triton.next_power_of_2(cols), num_warps=ops.norm_warps, launch_pdl=ops.pdl)
        return out, res_out

    def silu_mul(gate, up):
        rows, cols = gate.shape
        out = torch.empty(rows, cols, dtype=gate.dtype, device=gate.device)
        _silu_mul_then_library_kernel[(rows, triton.cdiv(cols, ops.silu_block))](
            gate, up, out, cols, gate.stride(0), up.stride(0), BLOCK=ops.silu_block, num_warps=ops.silu_warps,
            launch_pdl=ops.pdl)
        return out

    def set_layers(n):
        layers_x2_plus_1[0] = 2 * n + 1
        calls[0] = 0

    ops.add_rmsnorm, ops.silu_mul, ops.set_layers = add_rmsnorm, silu_mul, set_layers


def plain_ops(ops) -> None:
    for attr in ("add_rmsnorm", "silu_mul", "set_layers"):
        ops.__dict__.pop(attr, None)


def from_late(name: str | None) -> bool:
    return name is not None and name.startswith("_") and "_then_library_kernel" in name


def make_programmatic(graph, from_library: bool = False, only_from_late: bool = False) -> dict[str, int]:
    """Turn every ordinary edge kernel -> cuBLAS kernel into a programmatic one (from another
    cuBLAS kernel too only with `from_library`: the probe cannot make such a predecessor slow,
    so it cannot test that its successor waits); the names changed and how often."""
    names: dict[int, str | None] = {}

    def name_of(node):
        if node not in names:
            names[node] = kernel_name(ctypes.c_void_p(node))
        return names[node]

    changed: dict[str, int] = {}
    for src, dst, data in edges(graph):
        if data.type != 0 or name_of(src) is None or not is_library(name_of(dst)):
            continue
        if is_library(name_of(src)) and not from_library:
            continue
        if only_from_late and not from_late(name_of(src)):
            continue
        one_src, one_dst = (ctypes.c_void_p * 1)(src), (ctypes.c_void_p * 1)(dst)
        check(cuda().cuGraphRemoveDependencies_v2(graph, one_src, one_dst, ctypes.byref(data), ctypes.c_size_t(1)),
              "cuGraphRemoveDependencies")
        new = EdgeData(from_port=PROGRAMMATIC, to_port=0, type=PROGRAMMATIC)
        check(cuda().cuGraphAddDependencies_v2(graph, one_src, one_dst, ctypes.byref(new), ctypes.c_size_t(1)),
              "cuGraphAddDependencies")
        changed[name_of(dst)] = changed.get(name_of(dst), 0) + 1
    return changed


def edge_kinds(graph) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for _src, _dst, data in edges(graph):
        key = f"type{data.type}/port{data.from_port}"
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


class EdgedGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph whose edges into cuBLAS kernels become programmatic at capture_end."""

    changed: dict[str, int] = {}
    from_library = False
    only_from_late = False

    def __new__(cls, keep_graph: bool = False):
        return super().__new__(cls, True)

    def __init__(self, keep_graph: bool = False):
        super().__init__(True)

    def capture_end(self):
        super().capture_end()
        for name, n in make_programmatic(ctypes.c_void_p(self.raw_cuda_graph()), EdgedGraph.from_library,
                                                EdgedGraph.only_from_late).items():
            EdgedGraph.changed[name] = EdgedGraph.changed.get(name, 0) + n
        self.instantiate()


@triton.jit
def _spin_write(x_ptr, n, ns, BLOCK: tl.constexpr, LATE: tl.constexpr):
    """Spin `ns` nanoseconds, then write x = 1; the next kernel may launch at once or, LATE,
    only after the write (`_fence_and_trigger`)."""
    tl.extra.cuda.gdc_wait()
    if not LATE:
        tl.extra.cuda.gdc_launch_dependents()
    start = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - start < ns:
        pass
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.full((BLOCK,), 1.0, x_ptr.dtype.element_ty), mask=offs < n)
    if LATE:
        _fence_and_trigger()


def probe(kernels=("early", "late")) -> None:
    from services.rollout.builtin.kernels import TritonOps

    ops = TritonOps()
    shapes = {"0.5b": (896, 4864), "1.5b": (1536, 8960)}
    for shape, (hidden, inter) in shapes.items():
        products = {"gate_up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (151936, hidden)}
        for rows in (16, 64, 256):
            for what, (n, k) in products.items():
                torch.manual_seed(0)
                w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
                x = torch.zeros(rows, k, dtype=torch.bfloat16, device="cuda")
                want = F.linear(torch.ones_like(x), w)
                for path, kernel in [(p, k) for k in kernels for p in ("F.linear", "ops.linear")]:
                    product = F.linear if path == "F.linear" else ops.linear
                    product(torch.ones_like(x), w)  # choose, tune, warm up outside the capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph(keep_graph=True)
                    stream = torch.cuda.Stream()
                    with torch.cuda.stream(stream):
                        graph.capture_begin()
                        x.zero_()
                        _spin_write[(triton.cdiv(x.numel(), 4096),)](x, x.numel(), 50_000, BLOCK=4096,
                                                                     LATE=kernel == "late", launch_pdl=True)
                        out = product(x, w)
                        graph.capture_end()
                    raw = ctypes.c_void_p(graph.raw_cuda_graph())
                    before = edge_kinds(raw)
                    changed = make_programmatic(raw)
                    graph.instantiate()
                    bad = 0
                    for _ in range(20):
                        graph.replay()
                        torch.cuda.synchronize()
                        bad += not torch.equal(out, want)
                    print(f"{shape} {what:8s} rows {rows:3d} {path:10s} {kernel:5s} programmatic edges into "
                          f"{changed or 'nothing'}: {20 - bad}/20 replays right (edges before {before})", flush=True)


def step(names: list[str], batches: list[int]) -> None:
    from bench.experiments.alternate import FULL, alternate
    from bench.rollout import timed
    from services.rollout.types import Sampling

    plain = torch.cuda.CUDAGraph
    greedy = Sampling(temperature=0.0, max_new_tokens=16, ignore_eos=True, seed=1)
    reference: dict[tuple[int, str], list] = {}

    def apply(core, name):
        torch.cuda.CUDAGraph = EdgedGraph if name.startswith("pdl") or name == "late" else plain
        EdgedGraph.changed = {}
        EdgedGraph.from_library = name == "pdl_all"
        EdgedGraph.only_from_late = name == "late"
        if name in ("late", "late_kernels"):  # late_kernels: the kernels without the edges
            late_ops(core.ops)
            core.ops.set_layers(core.model.config.num_hidden_layers)
        else:
            plain_ops(core.ops)

    def describe(core, prompts):
        one = sorted(timed(lambda: core.generate(prompts, Sampling(temperature=1.0, max_new_tokens=1,
                                                                    ignore_eos=True, seed=1)), "cuda")
                     for _ in range(3))[1]
        outs = ([r.output_ids for r in core.generate(prompts, greedy)],
                [r.output_ids for r in core.generate(prompts, FULL)][:8])
        key = (core.model.config.hidden_size, len(prompts))
        same = reference.setdefault(key, outs) == outs
        changed = sum(EdgedGraph.changed.values())
        return f"1-token call {one * 1e3:.2f} ms  outputs {'same' if same else 'DIFFER'}  edges changed {changed}"

    alternate(names, batches, apply, describe=describe)
    torch.cuda.CUDAGraph = plain


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        probe(tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("early", "late"))
    else:
        sys.argv = sys.argv[1:]
        step(sys.argv[1].split(",") if len(sys.argv) > 1 else ["plain", "pdl"],
             [int(b) for b in sys.argv[2].split(",")] if len(sys.argv) > 2 else [16, 256])
