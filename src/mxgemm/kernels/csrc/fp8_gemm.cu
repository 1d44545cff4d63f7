// mxgemm FP8 GEMM for small and mid M on Hopper (sm_90a): y[M, N] = xq[M, K] @ W^T with the numerics of the
// cuBLASLt blockwise path (activations quantized to E4M3 with one fp32 scale per 1x128; the hybrid_sm90 weight: E4M3
// [Np, Kp] with fp32 128x128 block scales; Np % 16 == 0, Kp % 512 == 0), for the M where cuBLASLt's kernel leaves
// most of the GPU idle: many CTAs, K split over a thread-block cluster.
//
// Swap-AB on wgmma.m64nNk32 (e4m3 x e4m3 -> f32): 64 weight rows are the instruction's M, TN tokens its N.
// A CTA is RW consumer warpgroups (one per 64 weight rows) and one producer warp. The producer's lane 0 streams each
// 128-deep K block of the weight tiles and the activation tile into a ring of ST shared-memory stages with the tensor
// memory accelerator (TMA, 128-byte swizzle, rows past the tensor zero-filled), plus the block's token scales (a bulk
// copy), completing on an mbarrier per stage; with programmatic dependent launch the first stages' weight tiles load
// while the quantizer still runs. The consumers (the weight block scales staged in shared memory once) run 4 wgmma
// per block into a block accumulator, free the stage on a second mbarrier, and add the block's product times the
// weight block's scale and each token's scale into the fp32 result (the two-level accumulation of blockwise FP8: the
// tensor cores' own accumulation spans one 128-deep block only). With KC = 2 each row tile has two consumer
// warpgroups that take alternate K blocks (one multiplies while the other waits on its wgmma or promotes) and the
// second's result is added to the first's at the end. gridDim.y (<= 8) splits K; those CTAs form one cluster and rank
// 0 adds the others' results from distributed shared memory in rank order. Deterministic.
// A second kernel, fp8_gemm_tokm_kernel, turns the roles round for M > 32: tokens are wgmma's M (64 per consumer
// warpgroup) and 64 or 128 weight rows its N, so one weight tile serves 64-128 tokens and each thread promotes with
// two token scales per block; same ring, K split and numerics.
// What limits it, and the variants measured and dropped (a fused kernel that quantized the bf16 rows in shared
// memory among them): docs/performance.md.
// The 1x128 quantizer the GEMMs read is in quant_1x128.cuh, the SM90 helpers in sm90.cuh.
#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "graph_launch.cuh"
#include "quant_1x128.cuh"
#include "sm90.cuh"

#include <type_traits>

namespace cg = cooperative_groups;

using namespace sm90;

namespace {

constexpr int ROWS = 64;  // weight rows per wgmma: its M

// K split over the cluster (gridDim.y > 1): rank 0 adds the other ranks' results (N floats per consumer thread of
// CT) into its own, in rank order; returns false on the other ranks, which are done then. The ring holds the partials
// (every stage consumed).
template <int N, int CT>
__device__ __forceinline__ bool cluster_sum(float (&acc)[N], uint8_t* smem, bool consumer, int tid) {
  if (gridDim.y == 1) return true;
  __syncthreads();  // every stage consumed: the ring holds the partials now
  float* red = reinterpret_cast<float*>(smem);  // [N][CT]
  if (consumer) {
#pragma unroll
    for (int i = 0; i < N; ++i) red[i * CT + tid] = acc[i];
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  if (cluster.block_rank() == 0 && consumer) {
    for (unsigned int rank = 1; rank < cluster.num_blocks(); ++rank) {
      const float* other = cluster.map_shared_rank(red, rank);
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] += other[i * CT + tid];
    }
  }
  // the other ranks keep their shared memory until rank 0 has read it; nothing is published here, so the arrive
  // needs no release (cluster.sync's release fence shows in the stall samples)
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;" ::: "memory");
  return cluster.block_rank() == 0;
}

struct Args {
  const float* S;    // weight block scales [>= ceil(Np/128), s_stride]
  int s_stride;
  const float* XS;   // activation scales [Kp/128, Mp]
  __nv_bfloat16* Y;  // [M, ldy]
  int M, Mp, N, Np, Kp, ldy, kblocks;  // kblocks: 128-deep blocks per split
  const __nv_bfloat16* bias;  // [N] added in fp32 before the output's one rounding; null: none
};

__device__ __forceinline__ float bias_at(const Args& a, int col) { return a.bias ? __bfloat162float(a.bias[col]) : 0.f; }

// A consumer warpgroup of either kernel: K block it's product into blk once its ring stage is full, 4
// wgmma.m64nNk32 from the stage-0 descriptors of the A and B tiles moved to the stage, as one commit group
template <int N, int ST, int STAGE>
__device__ __forceinline__ void mma_block(float (&blk)[N / 2], uint64_t* full, int it, uint64_t a0, uint64_t b0) {
  const int s = it % ST;
  mbar_wait(&full[s], (it / ST) & 1);
  const uint64_t off = (uint64_t)(s * (STAGE / 16));
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < BK / 32; ++ks) wgmma<N>(blk, a0 + off + 2 * ks, b0 + off + 2 * ks, ks);
  wgmma_commit();
}

// The producer warp's lane 0 of either kernel: each 128-deep K block's weight tile (WR rows, in boxes of 64, at byte
// WOFF of the stage) and activation tile (TN tokens at byte XOFF) into the ring's next stage with TMA, and its token
// scales (a bulk copy of xs_bytes) into xsc, all completing on the stage's `full` mbarrier; a stage is refilled once
// its `empty` mbarrier says the consumers are done with it.
// The weight does not depend on the kernel before this one (the activation quantizer, or whatever wrote the
// activations): with programmatic dependent launch this grid starts early, so the first stages' weight tiles load
// while that kernel runs.
template <int ST, int STAGE, int WR, int WOFF, int TN, int XOFF>
__device__ __forceinline__ void produce(const CUtensorMap& wmap, const CUtensorMap& xmap, const Args& a,
                                        uint8_t* smem, float* xsc, uint64_t* full, uint64_t* empty, int row0, int tok0,
                                        int kb0, int xs_bytes) {
  const int tx = WR * BK + TN * BK + xs_bytes;
  auto weights = [&](int s, int it) {
    for (int r = 0; r < WR / ROWS; ++r)
      tma_load(smem + s * STAGE + WOFF + r * ROWS * BK, &wmap, (kb0 + it) * BK, row0 + r * ROWS, &full[s]);
  };
  auto activations = [&](int s, int it) {
    tma_load(smem + s * STAGE + XOFF, &xmap, (kb0 + it) * BK, tok0, &full[s]);
    bulk_load(xsc + s * TN, a.XS + (size_t)(kb0 + it) * a.Mp + tok0, xs_bytes, &full[s]);
  };
  const int pre = a.kblocks < ST ? a.kblocks : ST;
  for (int it = 0; it < pre; ++it) {
    mbar_expect_tx(&full[it], tx);
    weights(it, it);
  }
  griddep_wait();
  for (int it = 0; it < pre; ++it) activations(it, it);
  for (int it = pre; it < a.kblocks; ++it) {
    const int s = it % ST;
    mbar_wait(&empty[s], ((it / ST) & 1) ^ 1);  // the consumers are done with its last use
    mbar_expect_tx(&full[s], tx);
    weights(s, it);
    activations(s, it);
  }
}

template <int TN, int RW, int ST, int KC>
__global__ void __launch_bounds__(128 * RW * KC + 32) fp8_gemm_kernel(const __grid_constant__ CUtensorMap wmap,
                                                                 const __grid_constant__ CUtensorMap xmap,
                                                                 const Args a) {
  constexpr int WB = RW * ROWS * BK;  // weight bytes per stage
  constexpr int STAGE = WB + TN * BK;  // + e4m3 activation bytes; a multiple of 1024, as the swizzle needs
  static_assert(STAGE % 1024 == 0, "stages must stay 1024-byte aligned");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* xsc = reinterpret_cast<float*>(smem + ST * STAGE);  // [ST][TN] token scales of each stage
  uint64_t* full = reinterpret_cast<uint64_t*>(xsc + ST * TN);
  uint64_t* empty = full + ST;
  float* wsc = reinterpret_cast<float*>(empty + ST);  // [RW][kblocks] weight block scales of this CTA
  constexpr int CT = 128 * RW, NC = CT * KC;  // threads of one K-block group of consumers; all consumer threads
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // consumer warpgroup wg: weight rows row0 + 64 * (wg % RW), K blocks kc, kc + KC, ... (kc = wg / RW); warpgroup
  // RW * KC is the producer warp
  const int wg = warp / 4, r = wg % RW, kc = wg / RW;
  const int row0 = blockIdx.x * RW * ROWS, tok0 = blockIdx.z * TN, kb0 = blockIdx.y * a.kblocks;
  // token scales past Mp are not copied (their activations are zero-filled, their slots zeroed by the consumers)
  const int xs_bytes = (a.Mp - tok0 < TN ? a.Mp - tok0 : TN) * 4;

  if (tid == 0) {
    for (int s = 0; s < ST; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 4 * RW);  // one K-block group
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  float acc[TN / 2];
#pragma unroll
  for (int i = 0; i < TN / 2; ++i) acc[i] = 0.f;

  if (wg == RW * KC) {  // producer: weight tiles first in the stage, the activation tile after them
    if (lane == 0)
      produce<ST, STAGE, RW * ROWS, 0, TN, WB>(wmap, xmap, a, smem, xsc, full, empty, row0, tok0, kb0, xs_bytes);
  } else {  // consumers: RW x KC warpgroups
    // the weight scales (which do not depend on the kernel before either) staged once, while the first tiles load
    for (int i = tid; i < RW * a.kblocks; i += NC)
      wsc[i] = __ldg(a.S + (size_t)((row0 + (i / a.kblocks) * ROWS) / 128) * a.s_stride + kb0 + i % a.kblocks);
    // the token-scale slots past Mp are never copied: zero them once (their tokens' activations are zero-filled, and
    // stale shared memory could hold a NaN), so that the loop reads every slot unmasked
    const int valid = a.Mp - tok0;
    if (valid < TN)
      for (int i = tid; i < ST * TN; i += NC)
        if (i % TN >= valid) xsc[i] = 0.f;
    // the stage-0 descriptors of this warpgroup's weight tile and of the activation tile; stage s adds s * STAGE / 16
    const uint64_t dw0 = desc_sw128(smem_u32(smem) + r * ROWS * BK), dx0 = desc_sw128(smem_u32(smem) + WB);
    asm volatile("bar.sync 1, %0;" ::"r"(NC) : "memory");  // the consumers only
    float blk[TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) blk[i] = 0.f;
    for (int it = kc; it < a.kblocks; it += KC) {
      const int s = it % ST;
      mma_block<TN, ST, STAGE>(blk, full, it, dw0, dx0);
      const float sw = lds(wsc + r * a.kblocks + it);
      float tsc[TN / 8][2];  // this thread's tokens' scales times the weight block's (zero past Mp)
#pragma unroll
      for (int j = 0; j < TN / 8; ++j) {
        const float2 x = lds2(xsc + s * TN + 8 * j + 2 * t);  // an even slot
        tsc[j][0] = x.x * sw;
        tsc[j][1] = x.y * sw;
      }
      wgmma_wait0();
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
#pragma unroll
      for (int j = 0; j < TN / 8; ++j) {
        acc[4 * j + 0] = fmaf(blk[4 * j + 0], tsc[j][0], acc[4 * j + 0]);
        acc[4 * j + 1] = fmaf(blk[4 * j + 1], tsc[j][1], acc[4 * j + 1]);
        acc[4 * j + 2] = fmaf(blk[4 * j + 2], tsc[j][0], acc[4 * j + 2]);
        acc[4 * j + 3] = fmaf(blk[4 * j + 3], tsc[j][1], acc[4 * j + 3]);
      }
    }
    if constexpr (KC > 1) {  // the second K-block group's result added to the first's
      asm volatile("bar.sync 1, %0;" ::"r"(NC) : "memory");  // both groups done with the ring: it holds it now
      float* part = reinterpret_cast<float*>(smem);             // [TN / 2][CT]
      if (kc == 1) {
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) part[i * CT + tid - CT] = acc[i];
      }
      asm volatile("bar.sync 1, %0;" ::"r"(NC) : "memory");
      if (kc == 0) {
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) acc[i] += part[i * CT + tid];
      }
    }
  }

  if (!cluster_sum<TN / 2, CT>(acc, smem, wg < RW, tid)) return;
  if (wg >= RW) return;  // the producer and the second K-block group
#pragma unroll
  for (int j = 0; j < TN / 8; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = row0 + wg * ROWS + 16 * (warp % 4) + g + 8 * (i / 2), m = tok0 + 8 * j + 2 * t + (i % 2);
      if (m < a.M && row < a.N) a.Y[(size_t)m * a.ldy + row] = __float2bfloat16_rn(acc[4 * j + i] + bias_at(a, row));
    }
}

// Tokens as wgmma's M (the default config above M = 32; up to which M our kernel is the default:
// fp8_gemm.default_beats_cublas): TW consumer warpgroups of 64 tokens each share one tile of WN weight rows (the
// instruction's N, inside one 128-row scale block), so a stage's weight tile is read once for 64 * TW tokens and each
// thread promotes with two token scales and one weight scale per K block (the swap-AB kernel above reads TN / 4 token
// scales). The ring, its producer, the K split over a cluster and the numerics are the swap-AB kernel's.
template <int WN, int TW, int ST>
__global__ void __launch_bounds__(128 * TW + 32) fp8_gemm_tokm_kernel(const __grid_constant__ CUtensorMap wmap,
                                                                    const __grid_constant__ CUtensorMap xmap,
                                                                    const Args a) {
  constexpr int TN = 64 * TW;          // tokens per CTA
  constexpr int XB = TN * BK;          // activation bytes per stage
  constexpr int STAGE = XB + WN * BK;  // + weight bytes; a multiple of 1024, as the swizzle needs
  static_assert(STAGE % 1024 == 0 && WN % ROWS == 0 && WN <= 128, "stages must stay 1024-byte aligned");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* xsc = reinterpret_cast<float*>(smem + ST * STAGE);  // [ST][TN] token scales of each stage
  uint64_t* full = reinterpret_cast<uint64_t*>(xsc + ST * TN);
  uint64_t* empty = full + ST;
  float* wsc = reinterpret_cast<float*>(empty + ST);  // [kblocks] the weight tile's block scales
  constexpr int CT = 128 * TW;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, wg = warp / 4;
  const int trow = wg * 64 + 16 * (warp % 4) + g;  // a consumer thread's tokens in the tile: trow and trow + 8
  const int row0 = blockIdx.x * WN, tok0 = blockIdx.z * TN, kb0 = blockIdx.y * a.kblocks;
  const int xs_bytes = (a.Mp - tok0 < TN ? a.Mp - tok0 : TN) * 4;

  if (tid == 0) {
    for (int s = 0; s < ST; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 4 * TW);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  float acc[WN / 2];
#pragma unroll
  for (int i = 0; i < WN / 2; ++i) acc[i] = 0.f;

  if (wg == TW) {  // producer: the activation tile first in the stage, the weight tile after it
    if (lane == 0)
      produce<ST, STAGE, WN, XB, TN, 0>(wmap, xmap, a, smem, xsc, full, empty, row0, tok0, kb0, xs_bytes);
  } else {  // consumers
    for (int i = tid; i < a.kblocks; i += CT) wsc[i] = __ldg(a.S + (size_t)(row0 / 128) * a.s_stride + kb0 + i);
    const int valid = a.Mp - tok0;  // token-scale slots past Mp zeroed once, as in the swap-AB kernel
    if (valid < TN)
      for (int i = tid; i < ST * TN; i += CT)
        if (i % TN >= valid) xsc[i] = 0.f;
    const uint64_t dx0 = desc_sw128(smem_u32(smem) + wg * 64 * BK), dw0 = desc_sw128(smem_u32(smem) + XB);
    asm volatile("bar.sync 1, %0;" ::"r"(CT) : "memory");
    float blk[WN / 2];
#pragma unroll
    for (int i = 0; i < WN / 2; ++i) blk[i] = 0.f;
    for (int it = 0; it < a.kblocks; ++it) {
      const int s = it % ST;
      mma_block<WN, ST, STAGE>(blk, full, it, dx0, dw0);
      const float sw = lds(wsc + it);
      const float x0 = lds(xsc + s * TN + trow) * sw, x1 = lds(xsc + s * TN + trow + 8) * sw;
      wgmma_wait0();
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
      promote_rows<WN>(acc, blk, x0, x1);
    }
  }

  if (!cluster_sum<WN / 2, CT>(acc, smem, wg < TW, tid)) return;
  if (wg >= TW) return;
  // two adjacent columns per store where the row stride and the output keep them 4-byte aligned
  const bool paired = a.ldy % 2 == 0 && (reinterpret_cast<uintptr_t>(a.Y) & 3) == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int m = tok0 + trow + 8 * h;
    if (m >= a.M) continue;
    __nv_bfloat16* y = a.Y + (size_t)m * a.ldy;
#pragma unroll
    for (int j = 0; j < WN / 8; ++j) {
      const int col = row0 + 8 * j + 2 * t;
      const float v0 = acc[4 * j + 2 * h] + (col < a.N ? bias_at(a, col) : 0.f);
      const float v1 = acc[4 * j + 2 * h + 1] + (col + 1 < a.N ? bias_at(a, col + 1) : 0.f);
      if (paired && col + 1 < a.N) {
        *reinterpret_cast<__nv_bfloat162*>(y + col) = __floats2bfloat162_rn(v0, v1);
      } else {
        if (col < a.N) y[col] = __float2bfloat16_rn(v0);
        if (col + 1 < a.N) y[col + 1] = __float2bfloat16_rn(v1);
      }
    }
  }
}

// make_map through a small per-thread cache: a map encodes only the pointer, shape, stride and box, so an entry with
// the same five stays valid (eager calls reuse the weight's map, and the activation buffer's whenever the
// allocator hands the same address back)
int cached_map(CUtensorMap* map, const void* ptr, int rows, int cols, int ld, int box_rows) {
  struct Entry {
    const void* ptr;
    int rows, cols, ld, box_rows;
    CUtensorMap map;
  };
  thread_local Entry cache[64] = {};
  Entry& e = cache[((reinterpret_cast<uintptr_t>(ptr) >> 7) ^ (uintptr_t)rows ^ ((uintptr_t)box_rows << 3)) % 64];
  if (e.ptr == ptr && e.rows == rows && e.cols == cols && e.ld == ld && e.box_rows == box_rows) {
    *map = e.map;
    return 0;
  }
  const int err = make_map(map, ptr, rows, cols, ld, box_rows);
  if (!err) e = Entry{ptr, rows, cols, ld, box_rows, *map};
  return err;
}

using Kernel = void (*)(const CUtensorMap, const CUtensorMap, const Args);

// Launches either kernel on the quantizer's output XQ [Mp, Kp]: weight tensor map in boxes of 64 rows, activation
// map in boxes of `tokens` rows, a grid of
// (weight tiles of `rows`, K splits as one cluster, token tiles), `smem` bytes of shared memory (raised to the
// device's opt-in limit once per kernel: `max_smem`, per device), as a programmatic dependent when `pdl`.
int launch_kernel(Kernel kernel, int (&max_smem)[64], const void* W, const void* XQ, const Args& a, int splits,
                  int rows, int tokens, int threads, int smem, int pdl, cudaStream_t st) {
  CUtensorMap wmap, xmap;
  int err = cached_map(&wmap, W, a.Np, a.Kp, a.Kp, ROWS);
  if (!err) err = cached_map(&xmap, XQ, a.Mp, a.Kp, a.Kp, tokens);
  if (err) return err;
  int device = 0;
  cudaError_t cerr = cudaGetDevice(&device);
  if (cerr != cudaSuccess) return (int)cerr;
  int limit = device < 64 ? max_smem[device] : 0;
  if (limit == 0) {
    cerr = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (cerr == cudaSuccess) cerr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
    if (cerr != cudaSuccess) return (int)cerr;
    if (device < 64) max_smem[device] = limit;
  }
  if (smem > limit) return (int)cudaErrorInvalidValue;  // (every valid config fits)
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((a.Np + rows - 1) / rows, splits, (a.M + tokens - 1) / tokens);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = st;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = splits;
  attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // may start while the quantizer runs
  attr[1].val.programmaticStreamSerializationAllowed = pdl;
  config.attrs = attr;
  config.numAttrs = 2;
  cerr = graph_launch::launch_or_record(kernel, config, wmap, xmap, a);
  return (int)(cerr != cudaSuccess ? cerr : cudaGetLastError());
}

// the K blocks per split into a.kblocks; false when `splits` does not divide them or the weight is not padded
bool split_k(Args& a, int splits) {
  const int blocks = a.Kp / BK;
  a.kblocks = blocks / splits;
  return splits >= 1 && splits <= 8 && a.kblocks * splits == blocks && a.Np % 16 == 0;
}

// shared memory of a ring of ST stages of `stage` bytes, their token scales, mbarriers and `wsc` weight scales, or
// the consumers' results when larger (over the ring at the end); + 1024 for the alignment
constexpr int smem_bytes(int ST, int stage, int TN, int wsc, int red) {
  const int ring = ST * stage + ST * TN * 4 + 2 * ST * 8 + wsc * 4;
  return (ring > red ? ring : red) + 1024;
}

template <int TN, int RW, int ST, int KC>
int launch(const void* W, const void* XQ, Args a, int splits, int pdl, cudaStream_t st) {
  if (!split_k(a, splits)) return (int)cudaErrorInvalidValue;
  static int max_smem[64] = {};
  const int stage = RW * ROWS * BK + TN * BK;
  const int smem = smem_bytes(ST, stage, TN, RW * a.kblocks, RW * TN / 2 * 128 * 4);
  return launch_kernel(fp8_gemm_kernel<TN, RW, ST, KC>, max_smem, W, XQ, a, splits, RW * ROWS, TN,
                       128 * RW * KC + 32, smem, pdl, st);
}

template <int WN, int TW, int ST>
int launch_tokm(const void* W, const void* XQ, Args a, int splits, int pdl, cudaStream_t st) {
  if (!split_k(a, splits)) return (int)cudaErrorInvalidValue;
  static int max_smem[64] = {};
  const int smem = smem_bytes(ST, (64 * TW + WN) * BK, 64 * TW, a.kblocks, WN / 2 * 128 * TW * 4);
  return launch_kernel(fp8_gemm_tokm_kernel<WN, TW, ST>, max_smem, W, XQ, a, splits, WN, 64 * TW, 128 * TW + 32, smem,
                       pdl, st);
}

// f(std::integral_constant<int, ST>{}) for a ring depth of 2, 4 or 6
template <class F>
int by_stages(int stages, F f) {
  if (stages == 2) return f(std::integral_constant<int, 2>{});
  if (stages == 4) return f(std::integral_constant<int, 4>{});
  if (stages == 6) return f(std::integral_constant<int, 6>{});
  return (int)cudaErrorInvalidValue;
}

template <int RW, int KC>
int launch_tn(const void* W, const void* XQ, const Args& a, int tn, int splits, int stages, int pdl,
              cudaStream_t st) {
  auto tile = [&](auto tn) {
    return by_stages(stages, [&](auto s) { return launch<tn.value, RW, s.value, KC>(W, XQ, a, splits, pdl, st); });
  };
  if (tn == 8) return tile(std::integral_constant<int, 8>{});
  if (tn == 16) return tile(std::integral_constant<int, 16>{});
  if (tn == 32) return tile(std::integral_constant<int, 32>{});
  if (tn == 64) return tile(std::integral_constant<int, 64>{});
  if (tn == 128) return tile(std::integral_constant<int, 128>{});
  return (int)cudaErrorInvalidValue;
}

// The GEMM on the quantizer's output, any config
int gemm(const void* W, const void* XQ, const Args& a, int tokm, int tn, int rows, int kc, int splits,
         int stages, int pdl, cudaStream_t st) {
  auto tokm_st = [&](auto wn, auto tw) {
    return by_stages(stages, [&](auto s) { return launch_tokm<wn.value, tw.value, s.value>(W, XQ, a, splits, pdl, st); });
  };
  using I64 = std::integral_constant<int, 64>;
  using I128 = std::integral_constant<int, 128>;
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  if (tokm) {
    if (tn == 64 && rows == 64) return tokm_st(I64{}, I1{});
    if (tn == 64 && rows == 128) return tokm_st(I128{}, I1{});
    if (tn == 128 && rows == 64) return tokm_st(I64{}, I2{});
    if (tn == 128 && rows == 128) return tokm_st(I128{}, I2{});
    return (int)cudaErrorInvalidValue;
  }
  if (rows == 2 && kc == 1) return launch_tn<2, 1>(W, XQ, a, tn, splits, stages, pdl, st);
  if (rows == 1 && kc == 1) return launch_tn<1, 1>(W, XQ, a, tn, splits, stages, pdl, st);
  if (rows == 1 && kc == 2) return launch_tn<1, 2>(W, XQ, a, tn, splits, stages, pdl, st);
  return (int)cudaErrorInvalidValue;
}

int gemm_xq(const void* W, const void* S, int s_stride, const void* XQ, const void* XS, const void* bias, void* Y,
            int ldy, int M, int Mp, int N, int Np, int Kp, int tokm, int tn, int rows, int kc, int splits, int stages,
            int pdl, cudaStream_t st) {
  if (M < 1 || M > Mp) return (int)cudaErrorInvalidValue;
  const Args a{(const float*)S, s_stride, (const float*)XS, (__nv_bfloat16*)Y, M, Mp, N, Np, Kp, ldy, 0,
               (const __nv_bfloat16*)bias};
  return gemm(W, XQ, a, tokm, tn, rows, kc, splits, stages, pdl, st);
}

// The 1x128 quantizer of X, or (U not null) of the product a gated MLP feeds its down projection, silu(X) * U as
// PyTorch computes it in X's dtype (input_values); arguments as for mxgemm_quant_1x128.
int quant_1x128(const void* X, int ldx, const void* U, int ldu, int x_fp16, int M, int K, void* XQ, void* XS, int Mp,
                int Kp, cudaStream_t st) {
  if (M < 1 || M > Mp || Mp % 4 || K % 32 || K > Kp || Kp % BK) return (int)cudaErrorInvalidValue;
  cudaError_t err;
  if (U)
    err = x_fp16 ? launch_quant<__half, true>(X, ldx, U, ldu, M, K, XQ, XS, Mp, Kp, st)
                 : launch_quant<__nv_bfloat16, true>(X, ldx, U, ldu, M, K, XQ, XS, Mp, Kp, st);
  else
    err = x_fp16 ? launch_quant<__half>(X, ldx, nullptr, 0, M, K, XQ, XS, Mp, Kp, st)
                 : launch_quant<__nv_bfloat16>(X, ldx, nullptr, 0, M, K, XQ, XS, Mp, Kp, st);
  return (int)(err != cudaSuccess ? err : cudaGetLastError());
}

// One call for a whole FP8 linear on X, or (U not null) on silu(X) * U (tokm: tokens-as-M kernel with `rows` = wn,
// else swap-AB with `rows` = rw; other arguments as for mxgemm_fp8_gemm below): the quantizer (quant_1x128) into XQ /
// XS, then the GEMM as its programmatic dependent.
int fp8_linear(const void* X, int ldx, const void* U, int ldu, int x_fp16, int K, void* XQ, void* XS, const void* W,
               const void* S, int s_stride, const void* bias, void* Y, int ldy, int M, int Mp, int N, int Np, int Kp,
               int tokm, int tn, int rows, int kc, int splits, int stages, cudaStream_t st) {
  const int err = quant_1x128(X, ldx, U, ldu, x_fp16, M, K, XQ, XS, Mp, Kp, st);
  if (err) return err;
  return gemm_xq(W, S, s_stride, XQ, XS, bias, Y, ldy, M, Mp, N, Np, Kp, tokm, tn, rows, kc, splits, stages, 1, st);
}

}  // namespace

// The entry point mxgemm calls through ctypes; returns a cudaError_t (0: launched).
// xq [Mp, Kp] e4m3 and xs [Kp/128, Mp] fp32 as the 1x128 quantizer writes them; tn: tokens per CTA (8-128; more
// tokens run more CTAs along z); rw: 64-row weight tiles per CTA, a consumer warpgroup each (1, 2); kc: consumer
// warpgroups per row tile, taking alternate K blocks (1; 2 with rw = 1); splits: K splits, one cluster (1-8); stages:
// TMA ring depth (2, 4, 6); pdl: launch as a programmatic dependent of the kernel before.
extern "C" int mxgemm_fp8_gemm(const void* W, const void* S, int s_stride, const void* X, const void* XS,
                               const void* bias, void* Y, int ldy, int M, int Mp, int N, int Np, int Kp, int tn,
                               int rw, int kc, int splits, int stages, int pdl, void* stream) {
  return gemm_xq(W, S, s_stride, X, XS, bias, Y, ldy, M, Mp, N, Np, Kp, 0, tn, rw, kc, splits, stages, pdl,
                 (cudaStream_t)stream);
}

// Tokens as wgmma's M: tn tokens per CTA (64, 128: a consumer warpgroup per 64), wn weight rows per CTA (64, 128);
// splits and stages as above.
extern "C" int mxgemm_fp8_gemm_tokm(const void* W, const void* S, int s_stride, const void* X, const void* XS,
                                    const void* bias, void* Y, int ldy, int M, int Mp, int N, int Np, int Kp, int tn,
                                    int wn, int splits, int stages, int pdl, void* stream) {
  return gemm_xq(W, S, s_stride, X, XS, bias, Y, ldy, M, Mp, N, Np, Kp, 1, tn, wn, 1, splits, stages, pdl,
                 (cudaStream_t)stream);
}

// The 1x128 quantizer alone: x [M, K] bf16 (x_fp16 = 0) or fp16 with row stride ldx, into xq [Mp, Kp] e4m3 and
// xs [Kp/128, Mp] fp32 (Mp % 4 == 0, K % 32 == 0, K <= Kp, Kp % 128 == 0).
extern "C" int mxgemm_quant_1x128(const void* X, int ldx, int x_fp16, int M, int K, void* XQ, void* XS, int Mp, int Kp,
                                  void* stream) {
  return quant_1x128(X, ldx, nullptr, 0, x_fp16, M, K, XQ, XS, Mp, Kp, (cudaStream_t)stream);
}

// The same quantizer on the product a gated MLP feeds its down projection, silu(g) * u as PyTorch computes it in
// g's dtype (input_values): g and u [M, K] bf16 (x_fp16 = 0) or fp16 with row strides ldg and ldu.
extern "C" int mxgemm_quant_gated_1x128(const void* G, int ldg, const void* U, int ldu, int x_fp16, int M, int K,
                                        void* XQ, void* XS, int Mp, int Kp, void* stream) {
  return quant_1x128(G, ldg, U, ldu, x_fp16, M, K, XQ, XS, Mp, Kp, (cudaStream_t)stream);
}

// What mxgemm_fp8_linear_run takes besides the call's pointers: everything fixed for one weight, config and M (one
// ctypes argument instead of twenty: each costs host time on every call). The workspace lies in the output's
// allocation: XQ at Y + ws_offset bytes, XS q_bytes after it. `graphed`: outside stream capture, launch the call's
// kernels as one CUDA graph (`graph`, made on the first such call, freed by mxgemm_fp8_linear_plan_free).
struct LinearPlan {
  const void* W;
  const void* S;
  int s_stride, x_fp16, K, M, Mp, N, Np, Kp, tokm, tn, rows, kc, splits, stages;
  long long ws_offset, q_bytes;
  void* graph;
  int graphed, reserved;
};
static_assert(sizeof(LinearPlan) == 104, "fp8_gemm._LinearPlan mirrors this layout");

namespace {

// the plan's call on X, or (U not null) on silu(X) * U
int run_plan(const LinearPlan* p, const void* X, int ldx, const void* U, int ldu, const void* bias, void* Y,
             cudaStream_t stream) {
  uint8_t* xq = static_cast<uint8_t*>(Y) + p->ws_offset;
  return fp8_linear(X, ldx, U, ldu, p->x_fp16, p->K, xq, xq + p->q_bytes, p->W, p->S, p->s_stride, bias, Y, p->N,
                    p->M, p->Mp, p->N, p->Np, p->Kp, p->tokm, p->tn, p->rows, p->kc, p->splits, p->stages, stream);
}

int run_graphed(LinearPlan* p, const void* X, int ldx, const void* U, int ldu, const void* bias, void* Y,
                cudaStream_t stream) {
  if (p->graphed) {  // the quantizer and the GEMM launched as one graph (graph_launch.cuh): one launch's host time
    const int err = graph_launch::run_as_graph(
        &p->graph, [&](cudaStream_t s) { return run_plan(p, X, ldx, U, ldu, bias, Y, s); }, stream);
    if (err != graph_launch::kNotGraphed) return err;
  }
  return run_plan(p, X, ldx, U, ldu, bias, Y, stream);
}

}  // namespace

extern "C" int mxgemm_fp8_linear_run(LinearPlan* p, const void* X, int ldx, const void* bias, void* Y, void* stream) {
  return run_graphed(p, X, ldx, nullptr, 0, bias, Y, (cudaStream_t)stream);
}

// The plan's call on the product a gated MLP feeds its down projection, silu(g) * u (mxgemm_quant_gated_1x128), with
// the plain call's bits on that product: the gated quantizer, then the GEMM. A plan's graph is made for the kind of call it ran first; the other kind
// may launch directly: give each kind a plan of its own.
extern "C" int mxgemm_fp8_linear_gated_run(LinearPlan* p, const void* G, int ldg, const void* U, int ldu,
                                           const void* bias, void* Y, void* stream) {
  return run_graphed(p, G, ldg, U, ldu, bias, Y, (cudaStream_t)stream);
}

// Frees what a plan made (its graph); the plan's memory is its owner's
extern "C" void mxgemm_fp8_linear_plan_free(LinearPlan* p) { graph_launch::free_plan_graph(&p->graph); }
