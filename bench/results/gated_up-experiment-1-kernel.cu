// The gated MLP's first product with its activation, for a decode step's rows (Hopper, sm_90a):
//   out[m, j] = silu(x[m] . gate[j]) * (x[m] . up[j])   for j < I,
// where the weight is the engine's fused [2 I, K] tensor (gate rows, then up rows) and x is
// [M <= 128 * CONSUMERS, K], every value bf16, the products in float32, rounded as the decoder
// rounds (each product to bf16, then silu to bf16, then the product of the two).
//
// Why a kernel of our own: at 256 rows cuBLAS's fastest tile for the 0.5B shape (K = 896,
// 2 I = 9728) is 256 x 128, so 76 of the H200's 132 multiprocessors do the work, each bound by
// its own matrix units; smaller tiles would use them all but then every program reads all of x
// (~60 MB through L2 for 17 MB of weights). Here each program takes HALF gate and HALF up
// columns (0.5B: 40 + 40, 122 programs) and the programs of a cluster share x: each loads a
// 1/C slice of every x tile and the tensor memory accelerator multicasts it to all C. The
// activation happens in registers, so the [M, 2 I] product never goes to memory, and the
// weight tiles, which do not depend on the kernel before, are requested before the kernel waits
// for it (programmatic dependent launch).
//
// One producer warpgroup (one thread issues the loads) and CONSUMERS warpgroups of 128 rows
// each; STAGES tiles of 64 columns of k in flight, 128-byte swizzled, fed to wgmma from shared
// memory. Built by `services/rollout/builtin/cuda_kernels.py` with nvcc for sm_90a.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <stdint.h>

namespace {

constexpr int BK = 64;          // k columns a tile: 128 bytes of bf16, one swizzle span
constexpr int ROW_BYTES = BK * 2;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Arrive on the barrier at the same shared-memory offset in cluster CTA `cta`.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(cta)
      : "memory");
}

__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ void tma_load_multicast(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                                   uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%4, %5}], [%2], %3;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "h"(mask), "r"(c0), "r"(c1)
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// A shared-memory matrix descriptor for a K-major tile of 128-byte rows, 128-byte swizzled:
// groups of 8 rows 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>(16 >> 4) << 16;
  d |= static_cast<uint64_t>(1024 >> 4) << 32;
  d |= 1ull << 62;
  return d;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_bf16(float* d, uint64_t desc_a, uint64_t desc_b);

template <>
__device__ __forceinline__ void wgmma_bf16<80>(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n80k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
      : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<144>(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n144k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71}, %72, %73, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
      : "l"(desc_a), "l"(desc_b));
}

// silu(g) * u, rounded as the decoder (and the engine's Triton kernel) rounds.
__device__ __forceinline__ float silu_times(float g, float u) {
  float gf = __bfloat162float(__float2bfloat16_rn(g));
  float act = __bfloat162float(__float2bfloat16_rn(gf / (1.0f + __expf(-gf))));
  return act * __bfloat162float(__float2bfloat16_rn(u));
}

template <int HALF, int CONSUMERS, int STAGES>
struct Layout {
  static constexpr int BM = 128 * CONSUMERS;
  static constexpr int BN = 2 * HALF;
  static constexpr int A_BYTES = BM * ROW_BYTES;
  static constexpr int B_BYTES = BN * ROW_BYTES;
  static constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024;  // + alignment slack
  static_assert(B_BYTES % 1024 == 0 && HALF % 8 == 0, "tiles must keep the 1024-byte swizzle alignment");
};

template <int HALF, int CONSUMERS, int STAGES>
__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
    gated_up_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                    __nv_bfloat16* __restrict__ out, int rows, int inter, int out_stride, int k_tiles) {
  using L = Layout<HALF, CONSUMERS, STAGES>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[STAGES];
  __shared__ __align__(8) uint64_t empty[STAGES];
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u;
  const int warpgroup = threadIdx.x / 128;
  const uint32_t rank = cluster_rank();
  const uint32_t csize = cluster_size();
  const int tile = blockIdx.x;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), CONSUMERS * csize);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();  // every program's barriers exist before any load may land in them

  if (warpgroup == 0) {
    if (threadIdx.x == 0) {
      const int slice = L::BM / csize;  // x rows this program loads for the whole cluster
      const uint16_t mask = static_cast<uint16_t>((1u << csize) - 1);
      const int gate_row = tile * HALF, up_row = inter + tile * HALF;
      const int first = k_tiles < STAGES ? k_tiles : STAGES;
      // The weight tiles do not depend on the kernel before: ask for them first.
      for (int i = 0; i < first; ++i) {
        const uint32_t stage = base + i * L::STAGE_BYTES, bar = smem_addr(&full[i]);
        mbar_expect_tx(bar, L::STAGE_BYTES);
        tma_load(stage + L::A_BYTES, &w_map, bar, i * BK, gate_row);
        tma_load(stage + L::A_BYTES + HALF * ROW_BYTES, &w_map, bar, i * BK, up_row);
      }
      asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the kernel before's output
      for (int i = 0; i < k_tiles; ++i) {
        const int s = i % STAGES;
        const uint32_t stage = base + s * L::STAGE_BYTES, bar = smem_addr(&full[s]);
        if (i >= STAGES) {
          mbar_wait(smem_addr(&empty[s]), ((i / STAGES) - 1) & 1);  // free in every program of the cluster
          mbar_expect_tx(bar, L::STAGE_BYTES);
          tma_load(stage + L::A_BYTES, &w_map, bar, i * BK, gate_row);
          tma_load(stage + L::A_BYTES + HALF * ROW_BYTES, &w_map, bar, i * BK, up_row);
        }
        if (csize == 1) {
          tma_load(stage + rank * slice * ROW_BYTES, &x_map, bar, i * BK, rank * slice);
        } else {
          tma_load_multicast(stage + rank * slice * ROW_BYTES, &x_map, bar, i * BK, rank * slice, mask);
        }
      }
    }
  } else {
    const int consumer = warpgroup - 1;
    float acc[2][HALF];  // two 64-row halves of this warpgroup's 128 rows, HALF * 2 columns each / 2 per thread
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < HALF; ++c) acc[j][c] = 0.0f;
    for (int i = 0; i < k_tiles; ++i) {
      const int s = i % STAGES;
      const uint32_t stage = base + s * L::STAGE_BYTES;
      mbar_wait(smem_addr(&full[s]), (i / STAGES) & 1);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const uint64_t b = smem_desc(stage + L::A_BYTES + kk * 32);
        const uint32_t a = stage + consumer * 128 * ROW_BYTES + kk * 32;
        wgmma_bf16<2 * HALF>(acc[0], smem_desc(a), b);
        wgmma_bf16<2 * HALF>(acc[1], smem_desc(a + 64 * ROW_BYTES), b);
      }
      wgmma_commit();
      wgmma_wait<0>();
      if (threadIdx.x % 128 == 0) {
        for (uint32_t c = 0; c < csize; ++c) mbar_arrive_cluster(smem_addr(&empty[s]), c);
      }
    }
    asm volatile("griddepcontrol.launch_dependents;");
    // Accumulator layout of m64nNk16: thread t of the warpgroup holds rows 16 (t / 32) + (t % 32) / 4
    // (+ 8), and in each 8-column block columns 2 (t % 4) and + 1: acc[4 b + {0, 1}] the first row,
    // acc[4 b + {2, 3}] the row 8 below. Gate columns are blocks 0..HALF/8-1, up the rest.
    const int t = threadIdx.x % 128;
    const int row_in = 16 * (t / 32) + (t % 32) / 4;
    const int col_in = 2 * (t % 4);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = consumer * 128 + j * 64 + row_in + 8 * h;
        if (row >= rows) continue;
        __nv_bfloat16* out_row = out + static_cast<int64_t>(row) * out_stride;
#pragma unroll
        for (int b = 0; b < HALF / 8; ++b) {
          const int col = tile * HALF + 8 * b + col_in;
          if (col >= inter) continue;  // inter is even: col + 1 is in too
          const float* g = &acc[j][4 * b + 2 * h];
          const float* u = &acc[j][4 * (b + HALF / 8) + 2 * h];
          __nv_bfloat162 v = __floats2bfloat162_rn(silu_times(g[0], u[0]), silu_times(g[1], u[1]));
          *reinterpret_cast<__nv_bfloat162*>(out_row + col) = v;
        }
      }
    }
  }
  cluster_sync();  // no program leaves while a peer may still arrive on its barriers
}

typedef CUresult (*EncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encoder() {
  static EncodeTiled fn = nullptr;
  if (fn == nullptr) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib != nullptr) fn = reinterpret_cast<EncodeTiled>(dlsym(lib, "cuTensorMapEncodeTiled"));
  }
  return fn;
}

int encode(CUtensorMap* map, const void* ptr, uint64_t cols, uint64_t rows, uint64_t row_stride_bytes,
           uint32_t box_rows) {
  EncodeTiled fn = encoder();
  if (fn == nullptr) return -1;
  cuuint64_t dims[2] = {cols, rows};
  cuuint64_t strides[1] = {row_stride_bytes};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(BK), box_rows};
  cuuint32_t steps[2] = {1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box, steps,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : -2;
}

template <int HALF, int CONSUMERS, int STAGES>
int launch(const void* x, const void* w, void* out, int rows, int k, int inter, int x_stride, int out_stride,
           cudaStream_t stream, int cluster, int pdl) {
  using L = Layout<HALF, CONSUMERS, STAGES>;
  auto kernel = gated_up_kernel<HALF, CONSUMERS, STAGES>;
  static bool ready = false;
  if (!ready) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::SMEM);
    if (e != cudaSuccess) return static_cast<int>(e);
    ready = true;
  }
  CUtensorMap x_map, w_map;
  int r = encode(&x_map, x, k, rows, static_cast<uint64_t>(x_stride) * 2, L::BM / cluster);
  if (r != 0) return 1000 - r;
  r = encode(&w_map, w, k, 2 * static_cast<uint64_t>(inter), static_cast<uint64_t>(k) * 2, HALF);
  if (r != 0) return 1000 - r;
  const int tiles = (inter + HALF - 1) / HALF;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((tiles + cluster - 1) / cluster * cluster);
  config.blockDim = dim3(128 * (CONSUMERS + 1));
  config.dynamicSmemBytes = L::SMEM;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = cluster;
  attrs[0].val.clusterDim.y = 1;
  attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = pdl;
  config.attrs = attrs;
  config.numAttrs = 2;
  cudaError_t e = cudaLaunchKernelEx(&config, kernel, x_map, w_map, static_cast<__nv_bfloat16*>(out), rows, inter,
                                     out_stride, (k + BK - 1) / BK);
  return static_cast<int>(e);
}

}  // namespace

extern "C" {

// 0 on success; a cudaError_t, or 1000 + n for a tensor-map failure (1001: no driver entry point,
// 1002: the driver refused the map). `half` and `consumers` pick a compiled variant.
int rlf_gated_up(const void* x, const void* w, void* out, int rows, int k, int inter, int x_stride, int out_stride,
                 void* stream, int half, int consumers, int stages, int cluster, int pdl) {
  if (x_stride % 8 != 0 || k % 8 != 0 || inter % 2 != 0 || cluster < 1 || cluster > 8 ||
      (128 * consumers) % cluster != 0 || rows > 128 * consumers)
    return 2000;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
#define RLF_VARIANT(H, C, S)                                                                              \
  if (half == H && consumers == C && stages == S)                                                          \
    return launch<H, C, S>(x, w, out, rows, k, inter, x_stride, out_stride, s, cluster, pdl);
  RLF_VARIANT(40, 2, 4)
  RLF_VARIANT(40, 2, 5)
  RLF_VARIANT(40, 1, 4)
  RLF_VARIANT(40, 1, 6)
  RLF_VARIANT(72, 1, 6)
#undef RLF_VARIANT
  return 2001;
}

const char* rlf_error_string(int code) {
  if (code >= 2000) return code == 2000 ? "unsupported shape or cluster" : "no such compiled variant";
  if (code >= 1000) return code == 1001 ? "cuTensorMapEncodeTiled not found in libcuda" : "cuTensorMapEncodeTiled failed";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
