// mxgemm FP8 GEMM for small and mid M on Hopper (sm_90a): y[M, N] = xq[M, K] @ W^T with the numerics of the
// cuBLASLt blockwise path (activations quantized to E4M3 with one fp32 scale per 1x128, the hybrid_sm90 weight: E4M3
// [Np, Kp] with fp32 128x128 block scales; Np % 16 == 0, Kp % 512 == 0), written for the M where cuBLASLt's kernel
// leaves most of the GPU idle: many CTAs, K split over a thread-block cluster.
//
// Swap-AB on wgmma.m64nNk32 (e4m3 x e4m3 -> f32): 64 weight rows are the instruction's M, TN tokens its N. A CTA is
// one warpgroup; per 128-deep K block it runs 4 wgmma into a block accumulator, then adds that, times the weight
// block's scale and each token's activation scale, into the fp32 result (the accumulation cuBLASLt and DeepGEMM
// use for blockwise FP8: the tensor cores' own accumulation spans one 128-deep block only).
// Operands reach shared memory through cp.async, ST stages deep, in the no-swizzle K-major layout wgmma reads: 8x16
// byte core matrices of 128 contiguous bytes, the 8 core matrices of one 8-row group side by side along K.
// gridDim.y (<= 8) splits K; those CTAs form one cluster and rank 0 adds the others' results from distributed shared
// memory in rank order. Deterministic; one launch (plus the activation quantizer before it).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stdlib.h>

namespace cg = cooperative_groups;

namespace {

constexpr int BK = 128;   // K per stage: one scale block
constexpr int ROWS = 64;  // weight rows per CTA: wgmma's M

__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async4_zfill(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// shared-memory matrix descriptor, no swizzle: start address, K-direction core-matrix stride (LBO), 8-row-group
// stride (SBO)
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void wgmma_n32(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_n64(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_n128(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <int TN>
__device__ __forceinline__ void wgmma(float (&d)[TN / 2], uint64_t a, uint64_t b, int accumulate) {
  if constexpr (TN == 32) wgmma_n32(d, a, b, accumulate);
  if constexpr (TN == 64) wgmma_n64(d, a, b, accumulate);
  if constexpr (TN == 128) wgmma_n128(d, a, b, accumulate);
}

struct Args {
  const uint8_t* W;   // [Np, Kp] e4m3
  const float* S;     // weight block scales [>= ceil(Np/128), s_stride]
  int s_stride;
  const uint8_t* X;   // [Mp, Kp] e4m3
  const float* XS;    // activation scales [Kp/128, Mp]
  __nv_bfloat16* Y;   // [M, ldy]
  int M, Mp, N, Np, Kp, ldy, kblocks;  // kblocks: 128-deep blocks per split
  uint32_t lbo, sbo;
};

// byte offset of 16-byte chunk (row r, K chunk c of 8) in a stage's no-swizzle K-major tile
__device__ __forceinline__ uint32_t chunk_offset(int r, int c) { return ((r >> 3) * 8 + c) * 128 + (r & 7) * 16; }

template <int TN, int ST>
__global__ void __launch_bounds__(128) fp8_gemm_kernel(const Args a) {
  constexpr int WB = ROWS * BK;         // weight bytes per stage
  constexpr int XB = TN * BK;           // activation bytes per stage
  constexpr int STAGE = WB + XB + TN * 4;  // + the activation scales of the block
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * ROWS, tok0 = blockIdx.z * TN;
  const int kb0 = blockIdx.y * a.kblocks;

  auto issue = [&](int it) {
    if (it < a.kblocks) {
      const uint32_t stage = base + (it % ST) * STAGE;
      const size_t k0 = (size_t)(kb0 + it) * BK;
#pragma unroll
      for (int i = tid; i < ROWS * 8; i += 128) {  // weight: 64 rows x 8 chunks
        const int r = i / 8, c = i % 8, row = row0 + r;
        const bool in = row < a.Np;
        cp_async16_zfill(stage + chunk_offset(r, c), a.W + (in ? (size_t)row * a.Kp + k0 + 16 * c : 0), in ? 16 : 0);
      }
#pragma unroll
      for (int i = tid; i < TN * 8; i += 128) {  // activations: TN tokens x 8 chunks
        const int r = i / 8, c = i % 8, m = tok0 + r;
        const bool in = m < a.Mp;
        cp_async16_zfill(stage + WB + chunk_offset(r, c), a.X + (in ? (size_t)m * a.Kp + k0 + 16 * c : 0),
                         in ? 16 : 0);
      }
      if (tid < TN) {
        const int m = tok0 + tid;
        const bool in = m < a.Mp;
        cp_async4_zfill(stage + WB + XB + 4 * tid, a.XS + (in ? (size_t)(kb0 + it) * a.Mp + m : 0), in ? 4 : 0);
      }
    }
    cp_async_commit();
  };

  float acc[TN / 2], blk[TN / 2];
#pragma unroll
  for (int i = 0; i < TN / 2; ++i) acc[i] = blk[i] = 0.f;
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) issue(s);
  const float* wscale = a.S + (size_t)(row0 / 128) * a.s_stride + kb0;
  for (int it = 0; it < a.kblocks; ++it) {
    cp_async_wait<ST - 2>();  // this thread's copies of block `it` have landed
    fence_async_smem();       // ... and are visible to the tensor cores
    __syncthreads();          // everyone's; and the slot refilled next is no longer read
    issue(it + ST - 1);
    const float sw = __ldg(wscale + it);
    const uint32_t stage = base + (it % ST) * STAGE;
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < BK / 32; ++s)
      wgmma<TN>(blk, desc(stage + 2 * s * 128, a.lbo, a.sbo), desc(stage + WB + 2 * s * 128, a.lbo, a.sbo), s);
    wgmma_commit();
    wgmma_wait0();
    const float* xs = reinterpret_cast<const float*>(smem + (it % ST) * STAGE + WB + XB);
#pragma unroll
    for (int j = 0; j < TN / 8; ++j) {
      const float s0 = sw * xs[8 * j + 2 * t], s1 = sw * xs[8 * j + 2 * t + 1];
      acc[4 * j + 0] = fmaf(blk[4 * j + 0], s0, acc[4 * j + 0]);
      acc[4 * j + 1] = fmaf(blk[4 * j + 1], s1, acc[4 * j + 1]);
      acc[4 * j + 2] = fmaf(blk[4 * j + 2], s0, acc[4 * j + 2]);
      acc[4 * j + 3] = fmaf(blk[4 * j + 3], s1, acc[4 * j + 3]);
    }
  }

  if (gridDim.y > 1) {  // rank 0 of the cluster adds the other ranks' results, in rank order
    cp_async_wait<0>();
    __syncthreads();  // the stages are free: the partials go there
    float* red = reinterpret_cast<float*>(smem);  // [TN / 2][128]
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) red[i * 128 + tid] = acc[i];
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    if (cluster.block_rank() == 0) {
      for (unsigned int rank = 1; rank < cluster.num_blocks(); ++rank) {
        const float* other = cluster.map_shared_rank(red, rank);
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) acc[i] += other[i * 128 + tid];
      }
    }
    cluster.sync();
    if (cluster.block_rank() != 0) return;
  }
#pragma unroll
  for (int j = 0; j < TN / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + 16 * warp + g + 8 * (i / 2), m = tok0 + 8 * j + 2 * t + (i % 2);
      if (m < a.M && row < a.N) a.Y[(size_t)m * a.ldy + row] = __float2bfloat16_rn(acc[4 * j + i]);
    }
}

template <int TN, int ST>
int launch(Args a, int splits, cudaStream_t st) {
  const int blocks = a.Kp / BK;
  a.kblocks = blocks / splits;
  if (splits < 1 || splits > 8 || a.kblocks * splits != blocks || a.Np % 16 != 0) return (int)cudaErrorInvalidValue;
  constexpr int stage = ROWS * BK + TN * BK + TN * 4;
  constexpr int smem = ST * stage > TN / 2 * 128 * 4 ? ST * stage : TN / 2 * 128 * 4;
  auto kernel = fp8_gemm_kernel<TN, ST>;
  static bool raised[64] = {};  // the shared-memory limit, raised once per device
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return (int)err;
  if (device >= 64 || !raised[device]) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return (int)err;
    if (device < 64) raised[device] = true;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((a.Np + ROWS - 1) / ROWS, splits, (a.M + TN - 1) / TN);
  config.blockDim = dim3(128);
  config.dynamicSmemBytes = smem;
  config.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = splits;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  err = cudaLaunchKernelEx(&config, kernel, a);
  return (int)(err != cudaSuccess ? err : cudaGetLastError());
}

template <int TN>
int launch_st(const Args& a, int splits, int stages, cudaStream_t st) {
  if (stages == 2) return launch<TN, 2>(a, splits, st);
  if (stages == 3) return launch<TN, 3>(a, splits, st);
  if (stages == 4) return launch<TN, 4>(a, splits, st);
  return (int)cudaErrorInvalidValue;
}

}  // namespace

// The entry point mxgemm calls through ctypes; returns the launch's cudaError_t (0: launched).
// xq [Mp, Kp] e4m3 and xs [Kp/128, Mp] fp32 as the 1x128 quantizer writes them; tn: tokens per CTA (32, 64, 128;
// more tokens run more CTAs along z); splits: K splits, one cluster (1-8); stages: cp.async depth (2-4).
extern "C" int mxgemm_fp8_gemm(const void* W, const void* S, int s_stride, const void* X, const void* XS, void* Y,
                               int ldy, int M, int Mp, int N, int Np, int Kp, int tn, int splits, int stages,
                               void* stream) {
  if (M < 1 || M > Mp) return (int)cudaErrorInvalidValue;
  Args a{(const uint8_t*)W, (const float*)S, s_stride, (const uint8_t*)X, (const float*)XS, (__nv_bfloat16*)Y,
         M, Mp, N, Np, Kp, ldy, 0, 128, 1024};
  const char* swap = getenv("MXGEMM_FP8_DESC_SWAP");  // exploration only: which descriptor field is which
  if (swap && swap[0] == '1') a.lbo = 1024, a.sbo = 128;
  cudaStream_t st = (cudaStream_t)stream;
  if (tn == 32) return launch_st<32>(a, splits, stages, st);
  if (tn == 64) return launch_st<64>(a, splits, stages, st);
  if (tn == 128) return launch_st<128>(a, splits, stages, st);
  return (int)cudaErrorInvalidValue;
}
