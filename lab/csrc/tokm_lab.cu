// Variants of the tokens-as-M FP8 kernel at prefill sizes (lab/tokm_lab.py), the product's kernel file
// included for its helpers (TMA ring, wgmma, producer). 128 tokens (two consumer warpgroups of 64) x WN weight rows
// a CTA, a tile grid, one K split, the product's numerics (the same promotion order: its bits).
// WG3 = 1: a whole producer warpgroup (384 threads) that gives its registers to the consumers (setmaxnreg 40 / 232);
// OI = 1: the two consumer warpgroups issue their wgmma in turn (warpgroup 0 block k, warpgroup 1 block k, warpgroup 0
// block k + 1, ...; named barriers 2 and 3), so that one promotes while the tensor cores run the other's block;
// OI = 2: each issues its block once the other's block before it has finished (ping-pong: the two blocks' wgmma never
// share the tensor cores, so one warpgroup's promotion always overlaps the other's block).
// (A second block accumulator per warpgroup, the next block issued before the current one is promoted, makes ptxas
// serialize the wgmma: C7514.)
// SN = 1: each K block's wgmma as two independent chains, one per half of the weight rows (variants 8, 9).
// TW = 3: three consumer warpgroups (192 tokens a CTA; variants 10, 11), three blocks' wgmma sharing the tensor cores.
// MC = 1: CTAs in clusters of two token tiles that share the weight tile, each loading half of it with a TMA multicast
// into both (half the weight's reads from L2), as cuBLASLt's kernel runs in clusters of two.
// Measured (tokm_lab.py; results/tokm-lab-h200.json, tokm-lab-pingpong-h200.json, tokm-lab-chains-h200.json): none
// faster than the product's kernel. WG3 and OI = 1 within 5%; OI = 2 1.15-1.32x slower, so the two warpgroups' blocks
// must share the tensor cores to keep them busy; SN 1.11-1.15x slower (shorter wgmma); MC 1.6-2x slower. OI = 1 with
// 64-row tiles and 4 stages (two CTAs an SM) gives other bits on every shape, not understood (the product's kernel
// does not issue in turn). TW = 3 (tokm-lab-3wg-h200.json): with WG3 (the consumers at 152 registers) 0.92-0.94x the
// product's best time, still 1.08-1.49x cuBLASLt's; with a producer warp (ptxas caps its 416 threads at 128 registers
// and spills at WN = 128) 1.07-1.17x slower.
// The build cache keys this file alone: after fp8_gemm.cu changes, clear $MXGEMM_CACHE_DIR/kernels.
#include "fp8_gemm.cu"

namespace {

// cluster helpers (MC): this CTA's rank, a 2-D TMA box multicast to the CTAs of `mask` (the same shared-memory
// offset and mbarrier in each), an arrive on another CTA's mbarrier, and a barrier over the whole cluster
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void tma_load_mc(void* dst, const CUtensorMap* map, int k, int row, uint64_t* bar,
                                            uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3}], [%4], %5;" ::"r"(smem_u32(dst)),
      "l"(map), "r"(k), "r"(row), "r"(smem_u32(bar)), "h"(mask)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive_remote(uint64_t* bar, uint32_t rank) {
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}" ::"r"(smem_u32(bar)),
      "r"(rank)
      : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// MC's producer (lane 0 of the producer warp): as produce (one K split, no early weight loads), but each CTA of the
// pair loads half the weight tile (rank r: rows r * WN / 2 on) multicast into both, so a stage is refilled only once
// both CTAs' consumers are done with it (`empty` counts the two CTAs' consumer warps)
template <int ST, int STAGE, int WN, int XB, int TN>
__device__ __forceinline__ void produce_mc(const CUtensorMap& wmap, const CUtensorMap& xmap, const Args& a,
                                           uint8_t* smem, float* xsc, uint64_t* full, uint64_t* empty, int row0,
                                           int tok0, int xs_bytes, uint32_t rank) {
  const int tx = WN * BK + TN * BK + xs_bytes;
  for (int it = 0; it < a.kblocks; ++it) {
    const int s = it % ST;
    if (it >= ST) mbar_wait(&empty[s], ((it / ST) & 1) ^ 1);
    mbar_expect_tx(&full[s], tx);
    tma_load_mc(smem + s * STAGE + XB + rank * (WN / 2) * BK, &wmap, it * BK, row0 + rank * (WN / 2), &full[s], 3);
    tma_load(smem + s * STAGE, &xmap, it * BK, tok0, &full[s]);
    bulk_load(xsc + s * TN, a.XS + (size_t)it * a.Mp + tok0, xs_bytes, &full[s]);
  }
}

// SN's K block: the product's mma_block as two independent wgmma chains, one per half of the WN weight rows (each
// output element accumulates its four k32 steps in the same order: the same bits)
template <int WN, int ST, int STAGE>
__device__ __forceinline__ void mma_block_halves(float (&lo)[WN / 4], float (&hi)[WN / 4], uint64_t* full, int it,
                                                 uint64_t a0, uint64_t b0) {
  const int s = it % ST;
  mbar_wait(&full[s], (it / ST) & 1);
  const uint64_t off = (uint64_t)(s * (STAGE / 16)), half = (WN / 2) * BK / 16;
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < BK / 32; ++ks) {
    wgmma<WN / 2>(lo, a0 + off + 2 * ks, b0 + off + 2 * ks, ks);
    wgmma<WN / 2>(hi, a0 + off + 2 * ks, b0 + off + half + 2 * ks, ks);
  }
  wgmma_commit();
}

template <int WN, int ST, bool WG3, int OI, bool MC, bool SN = false, int TW = 2>
__global__ void __launch_bounds__(128 * TW + (WG3 ? 128 : 32), 1)
    tokm_lab_kernel(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap xmap, const Args a) {
  constexpr int TN = 64 * TW, XB = TN * BK, STAGE = XB + WN * BK, CT = 128 * TW;
  static_assert(!MC || WN == 128, "the pair's weight halves are one 64-row box each");
  static_assert(TW == 2 || (!MC && !OI), "pairs and issue orders are written for two consumer warpgroups");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* xsc = reinterpret_cast<float*>(smem + ST * STAGE);
  uint64_t* full = reinterpret_cast<uint64_t*>(xsc + ST * TN);
  uint64_t* empty = full + ST;
  float* wsc = reinterpret_cast<float*>(empty + ST);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4, wg = warp / 4;
  const int trow = wg * 64 + 16 * (warp % 4) + g;
  const int row0 = blockIdx.x * WN, tok0 = blockIdx.z * TN;
  const int xs_bytes = (a.Mp - tok0 < TN ? a.Mp - tok0 : TN) * 4;
  const uint32_t rank = MC ? cluster_rank() : 0;
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], (MC ? 2 : 1) * 4 * TW);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if constexpr (MC) cluster_sync();  // the pair's barriers exist before either multicasts or arrives remotely
  if (wg == TW) {
    if constexpr (WG3) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == CT) {
      if constexpr (MC)
        produce_mc<ST, STAGE, WN, XB, TN>(wmap, xmap, a, smem, xsc, full, empty, row0, tok0, xs_bytes, rank);
      else
        produce<ST, STAGE, WN, XB, TN, 0>(wmap, xmap, a, smem, xsc, full, empty, row0, tok0, 0, xs_bytes);
    }
  } else {
    // the registers the producer gives up, shared by the consumers: (65536 - 128 * 40) / (128 * TW), in steps of 8
    if constexpr (WG3 && TW == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    if constexpr (WG3 && TW == 3) asm volatile("setmaxnreg.inc.sync.aligned.u32 152;");
    for (int i = tid; i < a.kblocks; i += CT) wsc[i] = __ldg(a.S + (size_t)(row0 / 128) * a.s_stride + i);
    const uint64_t dx0 = desc_sw128(smem_u32(smem) + wg * 64 * BK), dw0 = desc_sw128(smem_u32(smem) + XB);
    asm volatile("bar.sync 1, %0;" ::"r"(CT) : "memory");
    float acc[WN / 2], blk[WN / 2], lo[WN / 4], hi[WN / 4];
#pragma unroll
    for (int i = 0; i < WN / 2; ++i) acc[i] = blk[i] = 0.f;
#pragma unroll
    for (int i = 0; i < WN / 4; ++i) lo[i] = hi[i] = 0.f;
    for (int kb = 0; kb < a.kblocks; ++kb) {
      // OI: warpgroup 1 after warpgroup 0 has issued (1) or finished (2) block kb, warpgroup 0 after warpgroup 1 has
      // issued or finished kb - 1
      if (OI && wg == 1) asm volatile("bar.sync 2, 256;" ::: "memory");
      if (OI && wg == 0 && kb > 0) asm volatile("bar.sync 3, 256;" ::: "memory");
      if constexpr (SN) mma_block_halves<WN, ST, STAGE>(lo, hi, full, kb, dx0, dw0);
      else mma_block<WN, ST, STAGE>(blk, full, kb, dx0, dw0);
      if (OI == 1 && wg == 0) asm volatile("bar.arrive 2, 256;" ::: "memory");
      if (OI == 1 && wg == 1 && kb + 1 < a.kblocks) asm volatile("bar.arrive 3, 256;" ::: "memory");
      // block kb's scales, then (its group complete) its stage freed and its product promoted
      const int s = kb % ST;
      const float sw = lds(wsc + kb);
      const float x0 = lds(xsc + s * TN + trow) * sw, x1 = lds(xsc + s * TN + trow + 8) * sw;
      wgmma_wait0();
      if (OI == 2 && wg == 0) asm volatile("bar.arrive 2, 256;" ::: "memory");
      if (OI == 2 && wg == 1 && kb + 1 < a.kblocks) asm volatile("bar.arrive 3, 256;" ::: "memory");
      __syncwarp();
      if (lane == 0) {
        mbar_arrive(&empty[s]);
        if constexpr (MC) mbar_arrive_remote(&empty[s], rank ^ 1);
      }
      if constexpr (SN) {
#pragma unroll
        for (int i = 0; i < WN / 4; ++i) blk[i] = lo[i], blk[WN / 4 + i] = hi[i];
      }
      promote_rows<WN>(acc, blk, x0, x1);
    }
    const bool paired = a.ldy % 2 == 0 && (reinterpret_cast<uintptr_t>(a.Y) & 3) == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = tok0 + trow + 8 * h;
      if (m >= a.M) continue;
      __nv_bfloat16* y = a.Y + (size_t)m * a.ldy;
#pragma unroll
      for (int j = 0; j < WN / 8; ++j) {
        const int col = row0 + 8 * j + 2 * t;
        const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
        if (paired && col + 1 < a.N) {
          *reinterpret_cast<__nv_bfloat162*>(y + col) = __floats2bfloat162_rn(v0, v1);
        } else {
          if (col < a.N) y[col] = __float2bfloat16_rn(v0);
          if (col + 1 < a.N) y[col + 1] = __float2bfloat16_rn(v1);
        }
      }
    }
  }
  if constexpr (MC) cluster_sync();  // neither CTA exits while the other may still arrive on its barriers
}

// grid (weight tiles, 1, token tiles of 64 * TW), clusters of two token tiles with MC
template <int WN, int ST, bool WG3, int OI, bool MC, bool SN = false, int TW = 2>
int lab_launch(const void* W, const Args& a, const void* XQ, cudaStream_t st) {
  constexpr int TN = 64 * TW;
  auto kernel = tokm_lab_kernel<WN, ST, WG3, OI, MC, SN, TW>;
  const int smem = smem_bytes(ST, (TN + WN) * BK, TN, a.kblocks, 0);
  const int tiles = (a.M + TN - 1) / TN;
  if (MC && tiles % 2) return (int)cudaErrorInvalidValue;
  CUtensorMap wmap, xmap;
  int err = cached_map(&wmap, W, a.Np, a.Kp, a.Kp, ROWS);
  if (!err) err = cached_map(&xmap, XQ, a.Mp, a.Kp, a.Kp, TN);
  if (err) return err;
  cudaError_t cerr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (cerr != cudaSuccess) return (int)cerr;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(a.Np / WN, 1, tiles);
  config.blockDim = dim3(128 * TW + (WG3 ? 128 : 32));
  config.dynamicSmemBytes = smem;
  config.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = MC ? 2 : 1;
  config.attrs = attr;
  config.numAttrs = 1;
  cerr = cudaLaunchKernelEx(&config, kernel, wmap, xmap, a);
  return (int)(cerr != cudaSuccess ? cerr : cudaGetLastError());
}

}  // namespace

// xq [Mp, Kp] e4m3 and xs [Kp/128, Mp] as the quantizer writes them (Mp % 128 == 0), W [Np, Kp] e4m3 with block
// scales S; variant: 0-3 bit 0 WG3, bit 1 OI = 1; 4, 5 MC (WN 128); 6, 7 OI = 2; 8, 9 SN; 10, 11 TW = 3 (each pair
// without and with WG3); wn 64 or 128; stages 4 or 6 (TW = 3 with WN = 128: 4). Returns a cudaError_t.
extern "C" int tokm_lab(const void* W, const void* S, int s_stride, const void* XQ, const void* XS, void* Y, int M,
                        int Mp, int N, int Np, int Kp, int wn, int stages, int variant, void* stream) {
  Args a{(const float*)S, s_stride, (const float*)XS, (__nv_bfloat16*)Y, M, Mp, N, Np, Kp, N, Kp / BK, nullptr};
  if (Mp % 128 || Kp % 512) return (int)cudaErrorInvalidValue;
  auto st = (cudaStream_t)stream;
  auto by_variant = [&](auto wn_, auto st_) {
    constexpr int WN = decltype(wn_)::value, ST = decltype(st_)::value;
    switch (variant) {
      case 0: return lab_launch<WN, ST, false, 0, false>(W, a, XQ, st);
      case 1: return lab_launch<WN, ST, true, 0, false>(W, a, XQ, st);
      case 2: return lab_launch<WN, ST, false, 1, false>(W, a, XQ, st);
      case 3: return lab_launch<WN, ST, true, 1, false>(W, a, XQ, st);
      case 6: return lab_launch<WN, ST, false, 2, false>(W, a, XQ, st);
      case 7: return lab_launch<WN, ST, true, 2, false>(W, a, XQ, st);
      case 8: return lab_launch<WN, ST, false, 0, false, true>(W, a, XQ, st);
      case 9: return lab_launch<WN, ST, true, 0, false, true>(W, a, XQ, st);
    }
    if constexpr (WN == 64 || ST == 4) {  // three warpgroups' stages of 128-row tiles: 4 fit shared memory
      if (variant == 10) return lab_launch<WN, ST, false, 0, false, false, 3>(W, a, XQ, st);
      if (variant == 11) return lab_launch<WN, ST, true, 0, false, false, 3>(W, a, XQ, st);
    }
    if constexpr (WN == 128) {
      if (variant == 4) return lab_launch<WN, ST, false, 0, true>(W, a, XQ, st);
      if (variant == 5) return lab_launch<WN, ST, true, 0, true>(W, a, XQ, st);
    }
    return (int)cudaErrorInvalidValue;
  };
  using I4 = std::integral_constant<int, 4>;
  using I6 = std::integral_constant<int, 6>;
  if (wn == 128 && stages == 4) return by_variant(std::integral_constant<int, 128>{}, I4{});
  if (wn == 128 && stages == 6) return by_variant(std::integral_constant<int, 128>{}, I6{});
  if (wn == 64 && stages == 4) return by_variant(std::integral_constant<int, 64>{}, I4{});
  if (wn == 64 && stages == 6) return by_variant(std::integral_constant<int, 64>{}, I6{});
  return (int)cudaErrorInvalidValue;
}
