"""An experiment (2026-12-03): matrix products for a decode step's gated MLP at 129-256 rows on Hopper, in CUDA C: built at
run time with NVRTC, launched through the driver API on torch's current stream (so CUDA graphs
capture them), with programmatic dependent launch like the Triton kernels.

- `wide`: x [rows <= 256, k] times a wide weight [n, k]^T (gate/up): every CTA computes all rows
  for `bn` weight rows, one wave of CTAs, and the CTAs of a cluster share x's loads (TMA
  multicast: one read through L2 lands in every CTA of the cluster).
- `down`: x [rows, k] times a long-k weight (down): the CTAs of a cluster split k for one 128 x 128
  output tile and add their sums in rank order through distributed shared memory.

Both sum k in a fixed order, so a product gives the same bits every run. One producer thread
issues TMA loads into a ring of shared-memory slots (mbarriers for "landed" and "free"), two
consumer warpgroups multiply with wgmma. Triton 3.6 expresses neither multicast nor distributed
shared memory, hence C. Used by `cluster_gemm.py` (alone) and `tile_step.py` (in the step).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

import torch

SOURCE = r"""
#define BM 256
#define BN @BN@
#define BK 64
#define STAGES @STAGES@
#define CL @CL@
#define XROWS (BM / CL)
#define X_BYTES (BM * BK * 2)
#define W_BYTES (BN * BK * 2)
#define NACC (BN / 2)

struct __align__(64) TMap { unsigned long long v[16]; };

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try(unsigned bar, unsigned parity) {
  unsigned ok;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
               " selp.u32 %0, 1, 0, p;\n}" : "=r"(ok) : "r"(bar), "r"(parity) : "memory");
  return ok;
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) { while (!mbar_try(bar, parity)) {} }
__device__ __forceinline__ void mbar_arrive_cta(unsigned bar, unsigned cta) {
  asm volatile("{\n .reg .b32 remote;\n mapa.shared::cluster.u32 remote, %0, %1;\n"
               " mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}" :: "r"(bar), "r"(cta) : "memory");
}
__device__ __forceinline__ void tma_load(unsigned dst, const TMap* map, int c0, int c1, unsigned bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               :: "r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void tma_load_multicast(unsigned dst, const TMap* map, int c0, int c1, unsigned bar,
                                                   unsigned short mask) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3}], [%4], %5;"
               :: "r"(dst), "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar), "h"(mask) : "memory");
}
__device__ __forceinline__ unsigned long long desc(unsigned addr) {
  // K-major operand, 128-byte swizzle: start >> 4, leading offset 1 (unused), stride 1024 B between 8-row groups
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}
__device__ __forceinline__ unsigned cta_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma(float* d, unsigned long long a, unsigned long long b) {
@WGMMA@
}

extern "C" __global__ void @CLUSTER_ATTR@ __launch_bounds__(384, 1)
mc_gemm(const __grid_constant__ TMap tx, const __grid_constant__ TMap tw, unsigned short* out, int rows, int n, int k,
        int ldo) {
  extern __shared__ unsigned char raw[];
  const unsigned base = (smem_u32(raw) + 1023) & ~1023u;
  const unsigned xs = base;                            // STAGES x [256 rows x 128 B]
  const unsigned ws = base + STAGES * X_BYTES;         // STAGES x [BN rows x 128 B]
  const unsigned bars = ws + STAGES * W_BYTES;         // full[STAGES], empty[STAGES]
  const int kblocks = k / BK;
  const int n0 = blockIdx.x * BN;
  const unsigned rank = CL > 1 ? cta_rank() : 0;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 8 * s, 1);
      mbar_init(bars + 8 * (STAGES + s), 2 * CL);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (CL > 1) cluster_sync();

  if (tid >= 256) {  // producer warpgroup: one thread issues every load
    if (tid == 256) {
      const int first = kblocks < STAGES ? kblocks : STAGES;
      for (int i = 0; i < first; ++i) {  // the weight needs nothing from the kernel before
        mbar_expect_tx(bars + 8 * i, X_BYTES + W_BYTES);
        tma_load(ws + i * W_BYTES, &tw, i * BK, n0, bars + 8 * i);
      }
      asm volatile("griddepcontrol.wait;" ::: "memory");
      for (int i = 0; i < kblocks; ++i) {
        const int s = i % STAGES;
        const unsigned full = bars + 8 * s;
        if (i >= STAGES) {
          mbar_wait(bars + 8 * (STAGES + s), ((i / STAGES) - 1) & 1);
          mbar_expect_tx(full, X_BYTES + W_BYTES);
          tma_load(ws + s * W_BYTES, &tw, i * BK, n0, full);
        }
        const unsigned dst = xs + s * X_BYTES + rank * XROWS * 128;
        if (CL > 1) tma_load_multicast(dst, &tx, i * BK, rank * XROWS, full, (unsigned short)((1 << CL) - 1));
        else tma_load(dst, &tx, i * BK, 0, full);
      }
    }
  } else {  // consumers: warpgroup g multiplies rows 128 g .. 128 g + 127
    const int g = tid / 128;
    float acc[2][NACC];
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int j = 0; j < NACC; ++j) acc[b][j] = 0.f;
    for (int i = 0; i < kblocks; ++i) {
      const int s = i % STAGES;
      mbar_wait(bars + 8 * s, (i / STAGES) & 1);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const unsigned long long bd = desc(ws + s * W_BYTES + kk * 32);
#pragma unroll
        for (int b = 0; b < 2; ++b)
          wgmma(acc[b], desc(xs + s * X_BYTES + (g * 128 + b * 64) * 128 + kk * 32), bd);
      }
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
      if (i > 0 && tid % 128 == 0) {
        const unsigned empty = bars + 8 * (STAGES + (i - 1) % STAGES);
        for (int c = 0; c < CL; ++c) mbar_arrive_cta(empty, c);
      }
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    const int warp = (tid % 128) / 32, lane = tid % 32;
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int r0 = g * 128 + b * 64 + warp * 16 + lane / 4;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = n0 + j * 8 + 2 * (lane % 4);
        if (col < n) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
            if (r < rows) {
              unsigned packed;
              asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(acc[b][4 * j + 2 * h + 1]), "f"(acc[b][4 * j + 2 * h]));
              *reinterpret_cast<unsigned*>(out + (long long)r * ldo + col) = packed;
            }
          }
        }
      }
    }
  }
  if (CL > 1) cluster_sync();  // no CTA leaves while a peer may still write to it
}
"""


DOWN_SOURCE = r"""
#define TM 128
#define TN 128
#define BK 64
#define STAGES @STAGES@
#define SPLITS @SPLITS@
#define A_BYTES (TM * BK * 2)
#define W_BYTES (TN * BK * 2)
#define RED_LD (TN + 4)
""" + SOURCE[SOURCE.index("struct __align__(64) TMap"):SOURCE.index("extern \"C\" __global__")] + r"""
extern "C" __global__ void __cluster_dims__(SPLITS, 1, 1) __launch_bounds__(384, 1)
mc_down(const __grid_constant__ TMap ta, const __grid_constant__ TMap tw, unsigned short* out, int rows, int n, int k,
        int ldo) {
  // out [rows, n] = a [rows, k] @ w [n, k]^T; the SPLITS CTAs of a cluster share one TM x TN output
  // tile, each a share of k; the shares' sums are added in rank order through distributed shared memory.
  extern __shared__ unsigned char raw[];
  const unsigned base = (smem_u32(raw) + 1023) & ~1023u;
  const unsigned as = base, ws = base + STAGES * A_BYTES, bars = ws + STAGES * W_BYTES;
  float* part = reinterpret_cast<float*>(raw + (base - smem_u32(raw)));  // [TM][RED_LD] over the slots, once done
  const int kblocks = k / BK;
  const unsigned rank = cta_rank();
  const int tile = blockIdx.x / SPLITS;
  const int m_tiles = (rows + TM - 1) / TM;
  const int m0 = (tile % m_tiles) * TM, n0 = (tile / m_tiles) * TN;
  const int kb0 = rank * kblocks / SPLITS, count = (rank + 1) * kblocks / SPLITS - kb0;
  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 8 * s, 1);
      mbar_init(bars + 8 * (STAGES + s), 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid >= 256) {
    if (tid == 256) {
      const int first = count < STAGES ? count : STAGES;
      for (int i = 0; i < first; ++i) {  // the weight needs nothing from the kernel before
        mbar_expect_tx(bars + 8 * i, A_BYTES + W_BYTES);
        tma_load(ws + i * W_BYTES, &tw, (kb0 + i) * BK, n0, bars + 8 * i);
      }
      asm volatile("griddepcontrol.wait;" ::: "memory");
      for (int i = 0; i < count; ++i) {
        const int s = i % STAGES;
        const unsigned full = bars + 8 * s;
        if (i >= STAGES) {
          mbar_wait(bars + 8 * (STAGES + s), ((i / STAGES) - 1) & 1);
          mbar_expect_tx(full, A_BYTES + W_BYTES);
          tma_load(ws + s * W_BYTES, &tw, (kb0 + i) * BK, n0, full);
        }
        tma_load(as + s * A_BYTES, &ta, (kb0 + i) * BK, m0, full);
      }
    }
  } else {
    const int g = tid / 128;  // rows 64 g .. 64 g + 63 of the tile
    float acc[TN / 2];
#pragma unroll
    for (int j = 0; j < TN / 2; ++j) acc[j] = 0.f;
    for (int i = 0; i < count; ++i) {
      const int s = i % STAGES;
      mbar_wait(bars + 8 * s, (i / STAGES) & 1);
      asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk)
        wgmma(acc, desc(as + s * A_BYTES + g * 64 * 128 + kk * 32), desc(ws + s * W_BYTES + kk * 32));
      asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
      asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
      if (i > 0 && tid % 128 == 0) mbar_arrive_cta(bars + 8 * (STAGES + (i - 1) % STAGES), rank);
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    asm volatile("bar.sync 1, 256;" ::: "memory");  // both consumer warpgroups are done with the slots
    const int warp = (tid % 128) / 32, lane = tid % 32;
    const int r0 = g * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < TN / 8; ++j) {
      const int c = j * 8 + 2 * (lane % 4);
      part[r0 * RED_LD + c] = acc[4 * j];
      part[r0 * RED_LD + c + 1] = acc[4 * j + 1];
      part[(r0 + 8) * RED_LD + c] = acc[4 * j + 2];
      part[(r0 + 8) * RED_LD + c + 1] = acc[4 * j + 3];
    }
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  cluster_sync();  // every CTA's partial sums are in its shared memory
  // CTA `rank` adds rows rank * TM / SPLITS ... of the tile over the cluster, CTA 0's first
  const int per = TM / SPLITS;
  for (int e = tid; e < per * TN / 4; e += 384) {
    const int r = rank * per + e / (TN / 4), c = (e % (TN / 4)) * 4;
    const unsigned local = smem_u32(part) + (r * RED_LD + c) * 4;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
    for (int src = 0; src < SPLITS; ++src) {
      unsigned remote;
      float v0, v1, v2, v3;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(src));
      asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                   : "=f"(v0), "=f"(v1), "=f"(v2), "=f"(v3) : "r"(remote) : "memory");
      s0 += v0; s1 += v1; s2 += v2; s3 += v3;
    }
    const int row = m0 + r, col = n0 + c;
    if (row < rows && col < n) {
      unsigned lo, hi;
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(s1), "f"(s0));
      asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(s3), "f"(s2));
      *reinterpret_cast<uint2*>(out + (long long)row * ldo + col) = make_uint2(lo, hi);
    }
  }
  cluster_sync();  // no CTA leaves while a peer may still read its partial sums
}
"""


def down_source(stages: int, splits: int) -> str:
    return (DOWN_SOURCE.replace("@STAGES@", str(stages)).replace("@SPLITS@", str(splits))
            .replace("@WGMMA@", _wgmma_asm(128)))


def _wgmma_asm(bn: int) -> str:
    regs = bn // 2
    operands = ", ".join(f"%{i}" for i in range(regs))
    return (f'  asm volatile("{{\\n .reg .pred p;\\n setp.eq.u32 p, 1, 1;\\n'
            f' wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.bf16.bf16 {{{operands}}}, '
            f'%{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}"\n'
            f'    : {", ".join(f"{chr(34)}+f{chr(34)}(d[{i}])" for i in range(regs))}\n'
            f'    : "l"(a), "l"(b) : "memory");')


def source(bn: int, stages: int, cl: int) -> str:
    cluster = f"__cluster_dims__({cl}, 1, 1)" if cl > 1 else ""
    return (SOURCE.replace("@BN@", str(bn)).replace("@STAGES@", str(stages)).replace("@CL@", str(cl))
            .replace("@WGMMA@", _wgmma_asm(bn)).replace("@CLUSTER_ATTR@", cluster))


def _nvrtc() -> ctypes.CDLL:
    candidates = [os.environ.get("NVRTC_LIB", "")]
    for root in sys.path + ["/usr/local/cuda/lib64"]:
        candidates += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
        candidates += sorted(glob.glob(os.path.join(root, "libnvrtc.so*")))
    for path in candidates:
        if path and "builtins" not in path and "alt" not in path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise RuntimeError("no libnvrtc found")


def _compile(code: str, arch: str, what: str) -> bytes:
    """NVRTC's CUBIN (what="CUBIN", arch sm_XX) or PTX (what="PTX", arch compute_XX) of `code`."""
    nvrtc = _nvrtc()
    prog = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"mc_gemm.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"-arch={arch}".encode(), b"-std=c++17", b"-default-device"]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc:
        raise RuntimeError(f"nvrtc: {log.value.decode()[:4000]}")
    getattr(nvrtc, f"nvrtcGet{what}Size")(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    getattr(nvrtc, f"nvrtcGet{what}")(prog, out)
    return out.raw


def compile_cubin(code: str, arch: str = "sm_90a") -> bytes:
    return _compile(code, arch, "CUBIN")


def ptx_of(code: str, arch: str = "sm_90a") -> str:
    return _compile(code, arch.replace("sm_", "compute_"), "PTX").rstrip(b"\0").decode()


class _Attr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_ubyte * 64)]


class _Config(ctypes.Structure):
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_Attr)), ("num_attrs", ctypes.c_uint)]


class ClusterGemm:  # one compiled kernel and its launches
    """out [rows, n] = x [rows, k] @ w [n, k]^T for bf16, k a multiple of 64. kind "wide": rows <= 256,
    every CTA all rows by `bn` weight rows, x multicast over clusters of `cl`; kind "down": clusters
    of `cl` CTAs split k for one 128 x 128 output tile and add their sums in rank order."""

    def __init__(self, bn: int = 80, stages: int = 4, cl: int = 2, kind: str = "wide"):
        self.bn, self.stages, self.cl, self.kind = bn, stages, cl, kind
        self.cuda = ctypes.CDLL("libcuda.so.1")
        torch.empty(1, device="cuda")  # the primary context is current
        if kind == "wide":
            code, name, self.smem = source(bn, stages, cl), b"mc_gemm", stages * (256 + bn) * 128 + 1024 + 16 * stages
        else:
            code, name, self.smem = down_source(stages, cl), b"mc_down", stages * 256 * 128 + 1024 + 16 * stages
        cubin = compile_cubin(code)
        self.module, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.cuda.cuModuleLoadData(ctypes.byref(self.module), cubin), "cuModuleLoadData")
        self._check(self.cuda.cuModuleGetFunction(ctypes.byref(self.fn), self.module, name), "GetFunction")
        self._check(self.cuda.cuFuncSetAttribute(self.fn, 8, self.smem), "max dynamic smem")
        self._maps: dict[tuple, ctypes.Array] = {}
        attr = _Attr()
        attr.id = 6  # PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value[0] = 1
        self._attrs = (_Attr * 1)(attr)

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what}: CUresult {rc}")

    def _map(self, t: torch.Tensor, box_rows: int) -> ctypes.Array:
        key = (t.data_ptr(), tuple(t.shape), box_rows)
        if key not in self._maps:
            m = (ctypes.c_uint64 * 16)()
            dims = (ctypes.c_uint64 * 2)(t.shape[1], t.shape[0])
            strides = (ctypes.c_uint64 * 1)(t.stride(0) * 2)
            box = (ctypes.c_uint32 * 2)(64, box_rows)
            elem = (ctypes.c_uint32 * 2)(1, 1)
            self._check(self.cuda.cuTensorMapEncodeTiled(m, 9, 2, ctypes.c_void_p(t.data_ptr()), dims, strides, box,
                                                         elem, 0, 3, 2, 0), "cuTensorMapEncodeTiled")
            self._maps[key] = m
        return self._maps[key]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows, k = x.shape
        n = w.shape[0]
        assert k % 64 == 0 and x.dtype == w.dtype == torch.bfloat16 and x.is_contiguous()
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device) if out is None else out
        if self.kind == "wide":
            assert rows <= 256
            tx, tw = self._map(x, 256 // self.cl), self._map(w, self.bn)
            ctas = -(-n // self.bn)
            ctas = -(-ctas // self.cl) * self.cl
        else:
            tx, tw = self._map(x, 128), self._map(w, 128)
            ctas = -(-rows // 128) * -(-n // 128) * self.cl
        args = [tx, tw, ctypes.c_void_p(out.data_ptr()), ctypes.c_int(rows), ctypes.c_int(n), ctypes.c_int(k),
                ctypes.c_int(out.stride(0))]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        config = _Config(ctas, 1, 1, 384, 1, 1, self.smem, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                         self._attrs, 1)
        self._check(self.cuda.cuLaunchKernelEx(ctypes.byref(config), self.fn, params, None), "cuLaunchKernelEx")
        return out
