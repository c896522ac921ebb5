// The gated MLP's first product with its activation, for a decode step's rows (Hopper, sm_90a):
//   out[t, j] = silu(x[t] . gate[j]) * (x[t] . up[j])   for tokens t < M <= 256 and j < I,
// where the weight is the engine's fused [2 I, K] tensor (gate rows, then up rows), every value
// bf16, the products in float32 and rounded as the decoder rounds (each product to bf16, then
// silu to bf16, then the product of the two): the bits of cuBLAS's product and the engine's SiLU
// kernel (cuBLAS sums k in one pass at these shapes, in the same order).
//
// Why a kernel of our own: the product and the SiLU are one pass, so the [M, 2 I] product never
// goes to memory and there is one launch a layer fewer; and the weight, which does not depend on
// the kernel before, is requested before the kernel waits for it (programmatic dependent launch),
// so its first tiles arrive while the norm before still runs. Each program takes 64 gate rows of
// the weight and their 64 up rows (on the matrix units' M side) against all the tokens (their N
// side, TN of them: 256 for a full batch, one wgmma of m64n256 per 16 columns of k and consumer
// warpgroup), STAGES tiles of 64 columns of k in flight, 128-byte swizzled. The weight tile is
// loaded as 8-row blocks of gate and up rows alternating, so that each thread's accumulators
// hold a gate row and its up row for the same tokens: the activation is computed in registers,
// then written to shared memory token-major for whole-line stores. Programs of a cluster share
// the token tile: each loads a 1/C slice and the tensor memory accelerator multicasts it to all C.
//
// An experiment (session 25, not in the engine: it lost to cuBLAS and the SiLU kernel, see
// bench/experiments/gated_up.py): built by `gated_up_build.py` with nvcc for sm_90a, called through ctypes.

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

// The weight tile of a chunk: 8-row blocks of gate and up rows alternating (a 4-D view of the
// fused weight: k, row in block, gate or up, block), so that each thread's two accumulator rows
// (r and r + 8) are a gate row and its up row.
__device__ __forceinline__ void tma_load_weight(uint32_t dst, const CUtensorMap* map, uint32_t bar, int k0, int block0) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(k0), "r"(0), "r"(0), "r"(block0)
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

__device__ __forceinline__ unsigned long long globaltime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
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
__device__ __forceinline__ void wgmma_bf16<64>(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<128>(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b));
}

template <>
__device__ __forceinline__ void wgmma_bf16<256>(float* d, uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(desc_a), "l"(desc_b));
}

// silu(g) * u, rounded as the decoder (and the engine's Triton kernel) rounds; u is already bf16.
__device__ __forceinline__ float silu_times(float g, float u) {
  float gf = __bfloat162float(__float2bfloat16_rn(g));
  float act = __bfloat162float(__float2bfloat16_rn(gf / (1.0f + __expf(-gf))));
  return act * u;
}

constexpr int W_ROWS = 64;  // gate rows a program takes, and as many up rows
constexpr int PITCH = W_ROWS + 8;  // the epilogue tile's row, in elements: 144 bytes

template <int TN, int STAGES>
struct Layout {
  static constexpr int W_BYTES = 2 * W_ROWS * ROW_BYTES;  // gate tile, then up tile
  static constexpr int X_BYTES = TN * ROW_BYTES;
  static constexpr int STAGE_BYTES = W_BYTES + X_BYTES;
  static constexpr int SMEM = STAGES * STAGE_BYTES + 1024;  // + alignment slack
  static_assert(TN * PITCH * 2 <= STAGES * STAGE_BYTES, "the epilogue's tile reuses the stages");
};

template <int TN, int STAGES>
__global__ void __launch_bounds__(384, 1)
    gated_up_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                    __nv_bfloat16* __restrict__ out, int rows, int inter, int out_stride, int k_tiles,
                    unsigned long long* trace) {
  using L = Layout<TN, STAGES>;
  // trace (an experiment's, else null): per program 48 stamps of %globaltimer (ns), see TRACE_*
  unsigned long long* stamps = trace == nullptr ? nullptr : trace + 48 * blockIdx.x;
  if (stamps != nullptr && threadIdx.x == 128) stamps[0] = globaltime();
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[STAGES];
  __shared__ __align__(8) uint64_t empty[STAGES];
  const uint32_t offset = ((smem_addr(smem_raw) + 1023u) & ~1023u) - smem_addr(smem_raw);
  uint8_t* smem = smem_raw + offset;  // 1024-byte aligned: the swizzle's period
  const uint32_t base = smem_addr(smem);
  const int warpgroup = threadIdx.x / 128;
  const uint32_t rank = cluster_rank();
  const uint32_t csize = cluster_size();
  const int tile = blockIdx.x;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), 2 * csize);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();  // every program's barriers exist before any load may land in them
  if (stamps != nullptr && threadIdx.x == 128) stamps[1] = globaltime();

  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      const int slice = TN / csize;  // token rows this program loads for the whole cluster
      const uint16_t mask = static_cast<uint16_t>((1u << csize) - 1);
      const int first = k_tiles < STAGES ? k_tiles : STAGES;
      // The weight tiles do not depend on the kernel before: ask for them first.
      for (int i = 0; i < first; ++i) {
        const uint32_t stage = base + i * L::STAGE_BYTES, bar = smem_addr(&full[i]);
        mbar_expect_tx(bar, L::STAGE_BYTES);
        tma_load_weight(stage, &w_map, bar, i * BK, tile * (W_ROWS / 8));
      }
      asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the kernel before's output
      if (stamps != nullptr) stamps[2] = globaltime();
      for (int i = 0; i < k_tiles; ++i) {
        const int s = i % STAGES;
        const uint32_t stage = base + s * L::STAGE_BYTES, bar = smem_addr(&full[s]);
        if (i >= STAGES) {
          mbar_wait(smem_addr(&empty[s]), ((i / STAGES) - 1) & 1);  // free in every program of the cluster
          if (stamps != nullptr && i < 16 + STAGES) stamps[32 + i - STAGES] = globaltime();
          mbar_expect_tx(bar, L::STAGE_BYTES);
          tma_load_weight(stage, &w_map, bar, i * BK, tile * (W_ROWS / 8));
        }
        const uint32_t x_dst = stage + L::W_BYTES + rank * slice * ROW_BYTES;
        if (csize == 1) {
          tma_load(x_dst, &x_map, bar, i * BK, rank * slice);
        } else {
          tma_load_multicast(x_dst, &x_map, bar, i * BK, rank * slice, mask);
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int consumer = warpgroup - 1;  // gate rows 32 c .. 32 c + 31 of the tile, and their up rows
    float acc[TN / 2];
#pragma unroll
    for (int c = 0; c < TN / 2; ++c) acc[c] = 0.0f;
    for (int i = 0; i < k_tiles; ++i) {
      const int s = i % STAGES;
      const uint32_t stage = base + s * L::STAGE_BYTES;
      mbar_wait(smem_addr(&full[s]), (i / STAGES) & 1);
      if (stamps != nullptr && threadIdx.x == 128 && i < 16) stamps[8 + i] = globaltime();
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        wgmma_bf16<TN>(acc, smem_desc(stage + consumer * W_ROWS * ROW_BYTES + kk * 32),
                       smem_desc(stage + L::W_BYTES + kk * 32));
      }
      wgmma_commit();
      wgmma_wait<0>();
      if (threadIdx.x % 128 == 0) {
        for (uint32_t c = 0; c < csize; ++c) mbar_arrive_cluster(smem_addr(&empty[s]), c);
      }
    }
    asm volatile("griddepcontrol.launch_dependents;");
    if (stamps != nullptr && threadIdx.x == 128) stamps[3] = globaltime();
    // m64nNk16's accumulators: thread t of the warpgroup holds A rows 16 (t / 32) + (t % 32) / 4 and 8
    // below, which the weight's layout makes gate row j = 32 c + 8 (t / 32) + (t % 32) / 4 of the tile
    // and its up row; in each block of 8 tokens, tokens 2 (t % 4) and + 1: acc[4 b + {0, 1}] gate,
    // acc[4 b + {2, 3}] up. The activations go to a token-major tile [TN][PITCH] over the stages
    // (every load has landed and, past the barrier, been read), padded against bank conflicts.
    __nv_bfloat16* act = reinterpret_cast<__nv_bfloat16*>(smem);
    const int t = threadIdx.x % 128;
    const int j = 32 * consumer + 8 * (t / 32) + (t % 32) / 4;
    const int tok0 = 2 * (t % 4);
    asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups are done with the stages
#pragma unroll
    for (int b = 0; b < TN / 8; ++b)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float up = __bfloat162float(__float2bfloat16_rn(acc[4 * b + 2 + e]));
        act[(8 * b + tok0 + e) * PITCH + j] = __float2bfloat16_rn(silu_times(acc[4 * b + e], up));
      }
    asm volatile("bar.sync 1, 256;" ::: "memory");
    if (stamps != nullptr && threadIdx.x == 128) stamps[4] = globaltime();
    // Whole 16-byte pieces of each token's 64 columns (inter is a multiple of 8).
    const int col0 = tile * W_ROWS;
    for (int piece = threadIdx.x - 128; piece < TN * (W_ROWS / 8); piece += 256) {
      const int token = piece / (W_ROWS / 8), col = 8 * (piece % (W_ROWS / 8));
      if (token < rows && col0 + col < inter) {
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(token) * out_stride + col0 + col) =
            *reinterpret_cast<const uint4*>(&act[token * PITCH + col]);
      }
    }
    if (stamps != nullptr && threadIdx.x == 128) stamps[5] = globaltime();
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
  if (fn == nullptr) return 1;
  cuuint64_t dims[2] = {cols, rows};
  cuuint64_t strides[1] = {row_stride_bytes};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(BK), box_rows};
  cuuint32_t steps[2] = {1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(ptr), dims, strides, box, steps,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : 2;
}

// The fused weight [2 I, K] as (k, row in an 8-row block, gate or up, block), a box of 64 columns
// of k by W_ROWS / 8 blocks of 8 gate rows each followed by its 8 up rows.
int encode_weight(CUtensorMap* map, const void* ptr, uint64_t k, uint64_t inter) {
  EncodeTiled fn = encoder();
  if (fn == nullptr) return 1;
  cuuint64_t dims[4] = {k, 8, 2, inter / 8};
  cuuint64_t strides[3] = {k * 2, inter * k * 2, 8 * k * 2};
  cuuint32_t box[4] = {static_cast<cuuint32_t>(BK), 8, 2, W_ROWS / 8};
  cuuint32_t steps[4] = {1, 1, 1, 1};
  CUresult r = fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(ptr), dims, strides, box, steps,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : 2;
}

template <int TN, int STAGES>
int launch(const void* x, const void* w, void* out, int rows, int k, int inter, int x_stride, int out_stride,
           cudaStream_t stream, int cluster, int pdl, unsigned long long* trace) {
  using L = Layout<TN, STAGES>;
  auto kernel = gated_up_kernel<TN, STAGES>;
  static bool ready = false;
  if (!ready) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, L::SMEM);
    if (e != cudaSuccess) return static_cast<int>(e);
    ready = true;
  }
  CUtensorMap x_map, w_map;
  int r = encode(&x_map, x, k, rows, static_cast<uint64_t>(x_stride) * 2, TN / cluster);
  if (r != 0) return 1000 + r;
  r = encode_weight(&w_map, w, k, inter);
  if (r != 0) return 1000 + r;
  const int tiles = (inter + W_ROWS - 1) / W_ROWS;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((tiles + cluster - 1) / cluster * cluster);
  config.blockDim = dim3(384);
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
                                     out_stride, (k + BK - 1) / BK, trace);
  return static_cast<int>(e);
}

}  // namespace

extern "C" {

// 0 on success; a cudaError_t, 1001 (no cuTensorMapEncodeTiled in libcuda), 1002 (the driver
// refused a tensor map), 2000 (a shape or cluster the kernel does not take), 2001 (no such
// compiled variant). `tokens` (TN) and `stages` pick a compiled variant.
int rlf_gated_up(const void* x, const void* w, void* out, int rows, int k, int inter, int x_stride, int out_stride,
                 void* stream, int tokens, int stages, int cluster, int pdl, void* trace) {
  if (rows < 1 || rows > tokens || x_stride % 8 != 0 || out_stride % 8 != 0 || k % 8 != 0 || inter % 8 != 0 ||
      cluster < 1 || cluster > 8 || tokens % cluster != 0)
    return 2000;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
#define RLF_VARIANT(TN, S) \
  if (tokens == TN && stages == S) return launch<TN, S>(x, w, out, rows, k, inter, x_stride, out_stride, s, cluster, pdl, \
                                                      static_cast<unsigned long long*>(trace));
  RLF_VARIANT(256, 4)
  RLF_VARIANT(128, 6)
  RLF_VARIANT(64, 8)
#undef RLF_VARIANT
  return 2001;
}

const char* rlf_error_string(int code) {
  if (code == 2000) return "unsupported shape or cluster";
  if (code == 2001) return "no such compiled variant";
  if (code == 1001) return "cuTensorMapEncodeTiled not found in libcuda";
  if (code == 1002) return "cuTensorMapEncodeTiled refused a tensor map";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
