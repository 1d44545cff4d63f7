// mxgemm's grouped FP8 GEMM for many rows per expert on Hopper (sm_90a): y[i] = xq[i] @ W_e^T for the expert e
// whose rows hold i (rows sorted by expert, `offsets` int32 [E] their cumulative ends), with the numerics of the
// w8a8-block recipe: activations quantized per 1x128 apart (E4M3 rows, fp32 scales), each expert's weight E4M3
// [N, K] with one fp32 scale per 128x128 block.
//
// Tokens as wgmma's M: a CTA is TW consumer warpgroups of 64 rows each sharing one tile of WN weight rows (the
// instruction's N, inside one 128-row scale block), and one producer warp whose lane 0 streams each 128-deep K block
// of the activation tile and the weight tile into a ring of ST shared-memory stages with the tensor memory
// accelerator (TMA, 128-byte swizzle; elements past a tensor read as zeros), completing on an mbarrier per stage.
// The consumers run 4 wgmma.m64nNk32 per block into a block accumulator, free the stage, and add the block's product
// times the weight block's scale and each row's scale into the fp32 result (the two-level accumulation of blockwise
// FP8). With 128-row tiles each consumer warpgroup keeps two block accumulators and issues the next block's wgmma
// before it adds the last block's product, so that the tensor cores run during that addition; their 192 registers a
// thread come from a producer warpgroup that gives its own away (setmaxnreg; its lane 0 of one warp loads). Each
// thread loads its two rows' scales and the weight block's scale of the next block from global memory while the
// tensor cores work (a tile starts at any row; a TMA copy of the scales from such rows stopped the kernel:
// docs/performance.md).
//
// Grouping: the work items are the routing's token tiles x the weight tiles, and every warp finds its items' expert
// and first row from `offsets` on the device (scanning the experts 32 at a time, from where its last scan ended), so
// nothing is read on the host and one CUDA graph replays any routing of the same row count. The grid is sized from
// the row count and E alone: a CTA per item of the largest routing (token-tile slots x weight tiles; CTAs past this
// routing's items return at once) or, persistent, as many CTAs as fit on the GPU, each taking the items gridDim.x
// apart, its producer loading the next item's blocks while its consumers store the last one's results. A tile's rows
// start wherever its expert's rows do (TMA boxes start at any row: no padded copy of the activations), and rows past
// the expert's end are computed and not written. The rows past the last expert's end are written as zeros. Items go
// in groups of SLOT_GROUP token tiles that sweep the weight tiles together, so an expert's weight tile is read from
// memory once for its token tiles and the group's activation tiles stay in L2. Output row i goes to row dst[i] where
// `dst` is given (the routed block's down projection writes each copy back to its token's place). On the persistent
// grid with 128-row tiles and no `dst`, a second kernel of the same body (grouped_kernel_tma) has each warpgroup whose
// 64 rows all belong to the tile's group write them into shared memory and one of its threads store them with TMA,
// so that its consumers start the next item while the copy runs; the other rows are stored from registers
// (docs/performance.md). Deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <type_traits>

#include "moe_routing.cuh"
#include "sm90.cuh"

using namespace sm90;

namespace {

constexpr int SLOT_GROUP = 8;  // token tiles that sweep the weight tiles together

struct Args {
  const float* S;      // expert e's weight block scales [ceil(N/128)][kblocks] at S + e * s_expert, s_stride apart
  long long s_expert;
  int s_stride;
  const int* offsets;  // [E] cumulative row ends
  const int* dst;      // [rows] output row of each row, or null: the row itself
  const float* XS;     // [kblocks][ld_xs] row scales
  int ld_xs;
  void* Y;             // [.., ldy], bf16 or fp16
  int rows, E, N, kblocks, ldy;
};

struct Grid {
  int slots;       // token-tile slots: one CTA per slot and weight tile...
  int persistent;  // ... or (non-zero) at most as many CTAs as fit on the GPU at once, each taking work items
};

struct Tile {
  int expert, tok0, end;  // expert E: the rows past the last expert's end; -1: no tile
};

// The token tile `slot` of the routing in tiles of TN rows, by one warp: group e < E holds rows [offsets[e - 1],
// offsets[e]), group E the rows past offsets[E - 1], each clamped to [0, rows]; groups take slots in order, one per
// tile they hold. Past the last tile: expert -1 and tok0 the routing's tile count. `from` carries the scan from the
// warp's last call (the first group of the 32 it ended in, and the tiles before that group): a later call for a slot
// at or past those tiles starts there.
struct Scan {
  int base = 0, before = 0;
};
template <int TN>
__device__ Tile find_tile(const Args& a, int slot, int lane, Scan& from) {
  if (slot < from.before) from = Scan{};
  int before = from.before;  // slots of the groups before this step's
  for (int base = from.base; base <= a.E; base += 32) {
    const int e = base + lane;
    int start = 0, end = 0;
    if (e <= a.E) {
      start = e == 0 ? 0 : min(max(__ldg(a.offsets + e - 1), 0), a.rows);
      end = e < a.E ? min(max(__ldg(a.offsets + e), 0), a.rows) : a.rows;
    }
    const int tiles = end > start ? (end - start + TN - 1) / TN : 0;
    int upto = tiles;  // inclusive scan over the lanes
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, upto, off);
      if (lane >= off) upto += v;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, before + upto > slot);
    if (hit) {
      from = Scan{base, before};
      const int f = __ffs(hit) - 1;
      const int first = before + __shfl_sync(0xffffffffu, upto - tiles, f);
      return Tile{base + f, __shfl_sync(0xffffffffu, start, f) + (slot - first) * TN,
                  __shfl_sync(0xffffffffu, end, f)};
    }
    before += __shfl_sync(0xffffffffu, upto, 31);
  }
  return Tile{-1, before, 0};
}

// two values rounded to T and packed as T's pair (the first at the lower address)
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float v0, float v1) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 p = __floats2half2_rn(v0, v1);
    memcpy(&bits, &p, 4);
  } else {
    const __nv_bfloat162 p = __floats2bfloat162_rn(v0, v1);
    memcpy(&bits, &p, 4);
  }
  return bits;
}
__device__ __forceinline__ void sts32(void* p, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(p)), "r"(v) : "memory");
}
// warpgroup wg's named barrier (1 or 2; 0 is __syncthreads'), constant ids so that ptxas reserves only those
__device__ __forceinline__ void bar_wg(int wg) {
  if (wg == 0)
    asm volatile("bar.sync 1, 128;" ::: "memory");
  else
    asm volatile("bar.sync 2, 128;" ::: "memory");
}
// shared-memory writes made visible to the async proxy (TMA) before it reads them
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// a 2-D TMA store of the box at `src` to (k, row) of `map` (k in bytes), in the thread's bulk group
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, int k, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(map), "r"(k),
               "r"(row), "r"(smem_u32(src))
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read0() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait0() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// an arrival on `bar` by the threads where `pred` holds, predicated rather than branched around
__device__ __forceinline__ void mbar_arrive_if(uint64_t* bar, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(
                   smem_u32(bar)),
               "r"((int)pred)
               : "memory");
}
// each register of `r` taken as read and written here, so that the compiler keeps its reads and writes on their side
// of the wgmma issues and waits around it
template <int N>
__device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

template <typename T>
__device__ __forceinline__ void store_pair(T* y, float v0, float v1) {
  *reinterpret_cast<uint32_t*>(y) = pack_pair<T>(v0, v1);
}

// The token-tile slot and weight tile of work item `idx` of `used` slots by `wtiles` weight tiles: groups of
// SLOT_GROUP slots, each sweeping the weight tiles
__device__ __forceinline__ void locate(int idx, int used, int wtiles, int& slot, int& wtile) {
  const int per_group = SLOT_GROUP * wtiles, group = idx / per_group, first = group * SLOT_GROUP;
  const int size = min(SLOT_GROUP, used - first), local = idx - group * per_group;
  slot = first + local % size;
  wtile = local / size;
}

// 128-row tiles: a producer warpgroup that gives its registers to the two consumer warpgroups (setmaxnreg 40 / 232;
// 9 warps get at most 168 registers a thread), whose two block accumulators and result take 192
__host__ __device__ constexpr int producer_threads(int TW) { return TW == 2 ? 128 : 32; }

// the kernels' body; TMA_OUT: whole 64-row slices through `ymap` (128-row tiles), their staging 1 KB past the ring's
// barriers
template <int WN, int TW, int ST, typename T, bool TMA_OUT>
__device__ __forceinline__ void grouped_body(const CUtensorMap& wmap, const CUtensorMap& xmap, const CUtensorMap* ymap,
                                             const Args& a) {
  constexpr int TN = 64 * TW;          // rows per CTA
  constexpr int XB = TN * BK;          // activation bytes per stage
  constexpr int STAGE = XB + WN * BK;  // + weight bytes; a multiple of 1024, as the swizzle needs
  constexpr int OUT = 64 * WN * 2;     // a warpgroup's output tile: WN / 64 boxes of 64 x 64 16-bit elements
  static_assert(STAGE % 1024 == 0 && (WN == 64 || WN == 128), "stages must stay 1024-byte aligned");
  static_assert(!TMA_OUT || TW == 2, "TMA stores with 128-row tiles");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + ST * STAGE);
  uint64_t* empty = full + ST;
  uint8_t* out_smem = smem + ST * STAGE + 1024;  // TMA_OUT: TW output tiles, each staged for its TMA store
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  // 128-row tiles: the warpgroup and the tile's expert read from lane 0, which ptxas knows warp-uniform
  const int wg = TW == 2 ? __shfl_sync(0xffffffffu, warp / 4, 0) : warp / 4;

  if (tid == 0) {
    for (int s = 0; s < ST; ++s) mbar_init(&full[s], 1), mbar_init(&empty[s], 4 * TW);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // the work items: the routing's token tiles by the weight tiles, taken gridDim.x apart; every warp finds its
  // items' tiles itself (the same answers), so the producer runs ahead of the consumers across items
  Scan scan;
  const int wtiles = (a.N + WN - 1) / WN, used = find_tile<TN>(a, INT_MAX, lane, scan).tok0, items = used * wtiles;
  int stage = 0;  // ring stages filled (producer) or consumed (consumers) so far

  if (wg == TW) {  // producer: the activation tile first in the stage, the weight tile after it
    if constexpr (TW == 2) {
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
      if (warp != 4 * TW) return;  // one warp loads
    }
    for (int idx = blockIdx.x; idx < items; idx += gridDim.x) {
      int slot, wtile;
      locate(idx, used, wtiles, slot, wtile);
      const Tile my = find_tile<TN>(a, slot, lane, scan);
      if (my.expert >= a.E) continue;  // rows past the last expert: nothing to load
      if (lane == 0) {
        const int wrow = my.expert * a.N + wtile * WN;
        for (int it = 0; it < a.kblocks; ++it) {
          const int n = stage + it, s = n % ST;
          if (n >= ST) mbar_wait(&empty[s], ((n / ST) & 1) ^ 1);  // the consumers are done with its last use
          mbar_expect_tx(&full[s], STAGE);
          uint8_t* dst = smem + s * STAGE;
          tma_load(dst, &xmap, it * BK, my.tok0, &full[s]);
#pragma unroll
          for (int r = 0; r < WN / 64; ++r) tma_load(dst + XB + r * 64 * BK, &wmap, it * BK, wrow + r * 64, &full[s]);
        }
      }
      stage += a.kblocks;
    }
    return;
  }

  if constexpr (TW == 2) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const int trow = wg * 64 + 16 * (warp % 4) + g;  // a consumer thread's rows in the tile: trow and trow + 8
  const uint64_t dx0 = desc_sw128(smem_u32(smem) + wg * 64 * BK), dw0 = desc_sw128(smem_u32(smem) + XB);
  // two adjacent columns per store where the row stride and the output keep them 4-byte aligned
  const bool paired = a.ldy % 2 == 0 && (reinterpret_cast<uintptr_t>(a.Y) & 3) == 0;
  for (int idx = blockIdx.x; idx < items; idx += gridDim.x) {
    int slot, wtile;
    locate(idx, used, wtiles, slot, wtile);
    Tile my = find_tile<TN>(a, slot, lane, scan);
    if constexpr (TW == 2) my.expert = __shfl_sync(0xffffffffu, my.expert, 0);
    const int n0 = wtile * WN;
    float acc[WN / 2];
#pragma unroll
    for (int i = 0; i < WN / 2; ++i) acc[i] = 0.f;
    if (my.expert < a.E) {  // else rows past the last expert: zeros
      // the weight tile's block scales, and the thread's two rows' scales (rows past the activations clamped: their
      // results are not written), each block's loaded while the tensor cores run the one before
      const float* sw = a.S + my.expert * a.s_expert + (long long)(n0 / 128) * a.s_stride;
      const float* xs0 = a.XS + min(my.tok0 + trow, a.ld_xs - 1);
      const float* xs1 = a.XS + min(my.tok0 + trow + 8, a.ld_xs - 1);
      float next0 = __ldg(xs0), next1 = __ldg(xs1), nextw = __ldg(sw);
      // block it's wgmma into b once its stage is full (the operand fence keeps the compiler from moving b's last
      // reads below it)
      auto issue = [&](float(&b)[WN / 2], int it) {
        const int n = stage + it, s = n % ST;
        mbar_wait(&full[s], (n / ST) & 1);
        const uint64_t off = (uint64_t)(s * (STAGE / 16));
        fence_operands(b);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BK / 32; ++ks) wgmma<WN>(b, dx0 + off + 2 * ks, dw0 + off + 2 * ks, ks);
        wgmma_commit();
      };
      if constexpr (TW == 2) {
        // 128-row tiles: two block accumulators, block it + 1's wgmma issued into one before block it, in the other,
        // is promoted, so that the tensor cores run while the warpgroup promotes (the operand fences keep the compiler
        // from moving a read of a block's registers above the wait that retires it); 64-row tiles promote each block
        // after it (two accumulators take them past the registers of two CTAs an SM)
        float b0[WN / 2], b1[WN / 2];
        // block it, done in b: block it + 1 issued into `other`, b promoted while it runs, block it + 1 waited for
        auto step = [&](float(&b)[WN / 2], float(&other)[WN / 2], int it) {
          const float x0 = next0 * nextw, x1 = next1 * nextw;
          const bool more = it + 1 < a.kblocks;
          if (more) {
            next0 = __ldg(xs0 + (size_t)(it + 1) * a.ld_xs), next1 = __ldg(xs1 + (size_t)(it + 1) * a.ld_xs);
            nextw = __ldg(sw + it + 1);
            issue(other, it + 1);
          }
          promote_rows<WN>(acc, b, x0, x1);
          wgmma_wait0();
          fence_operands(other);
          __syncwarp();
          mbar_arrive_if(&empty[(stage + it + 1) % ST], more && lane == 0);
        };
        issue(b0, 0);
        wgmma_wait0();
        fence_operands(b0);
        __syncwarp();
        mbar_arrive_if(&empty[stage % ST], lane == 0);
        for (int it = 0; it < a.kblocks; it += 2) {
          step(b0, b1, it);
          if (it + 1 < a.kblocks) step(b1, b0, it + 1);
        }
      } else {
        float blk[WN / 2];
        for (int it = 0; it < a.kblocks; ++it) {
          issue(blk, it);
          const float x0 = next0 * nextw, x1 = next1 * nextw;
          if (it + 1 < a.kblocks) {
            next0 = __ldg(xs0 + (size_t)(it + 1) * a.ld_xs), next1 = __ldg(xs1 + (size_t)(it + 1) * a.ld_xs);
            nextw = __ldg(sw + it + 1);
          }
          wgmma_wait0();
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[(stage + it) % ST]);
          promote_rows<WN>(acc, blk, x0, x1);
        }
      }
      stage += a.kblocks;
    }
    if constexpr (TMA_OUT) {
      // a warpgroup whose 64 rows all belong to the tile's group stages them (64 x 64 boxes in the 128-byte swizzle)
      // and one thread stores them with TMA; the others store from registers
      if (my.tok0 + wg * 64 + 64 <= my.end) {
        uint8_t* buf = out_smem + wg * OUT;
        const bool leader = warp % 4 == 0 && lane == 0;
        if (leader) bulk_wait_read0();  // the last tile's store has read the buffer
        bar_wg(wg);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * (warp % 4) + g + 8 * h;  // the row in the warpgroup's 64; r % 8 == g
#pragma unroll
          for (int j = 0; j < WN / 8; ++j)
            sts32(buf + (j / 8) * 8192 + r * 128 + (((j % 8) ^ g) * 16) + 4 * t,
                  pack_pair<T>(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
        }
        fence_async_smem();
        bar_wg(wg);
        if (leader) {
#pragma unroll
          for (int b = 0; b < WN / 64; ++b) tma_store(ymap, buf + b * 8192, 2 * (n0 + 64 * b), my.tok0 + wg * 64);
          bulk_commit();
        }
        continue;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = my.tok0 + trow + 8 * h;
      if (m >= my.end) continue;
      T* y = static_cast<T*>(a.Y) + (size_t)(a.dst ? __ldg(a.dst + m) : m) * a.ldy;
#pragma unroll
      for (int j = 0; j < WN / 8; ++j) {
        const int col = n0 + 8 * j + 2 * t;
        const float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
        if (paired && col + 1 < a.N) {
          store_pair(y + col, v0, v1);
        } else {
          if (col < a.N) y[col] = static_cast<T>(v0);
          if (col + 1 < a.N) y[col + 1] = static_cast<T>(v1);
        }
      }
    }
  }
  if constexpr (TMA_OUT)
    if (warp % 4 == 0 && lane == 0) bulk_wait0();  // the TMA stores done before the CTA's shared memory goes
}

template <int WN, int TW, int ST, typename T>
__global__ void __launch_bounds__(128 * TW + producer_threads(TW), TW == 2 ? 1 : 0)
    grouped_kernel(const __grid_constant__ CUtensorMap wmap, const __grid_constant__ CUtensorMap xmap, const Args a) {
  grouped_body<WN, TW, ST, T, false>(wmap, xmap, nullptr, a);
}
template <int WN, int ST, typename T>
__global__ void __launch_bounds__(384, 1) grouped_kernel_tma(const __grid_constant__ CUtensorMap wmap,
                                                          const __grid_constant__ CUtensorMap xmap, const Args a,
                                                          const __grid_constant__ CUtensorMap ymap) {
  grouped_body<WN, 2, ST, T, true>(wmap, xmap, &ymap, a);
}

// `kernel` launched with `smem` bytes of shared memory on a CTA per work item or, persistent, as many as fit
template <int WN, class K, class... P>
int start(K kernel, int threads, int smem, const Args& a, Grid grid, cudaStream_t stream, const P&... params) {
  int device = 0, limit = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return (int)err;
  if (smem > limit) return (int)cudaErrorInvalidValue;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return (int)err;
  long long ctas = (long long)grid.slots * ((a.N + WN - 1) / WN);
  if (grid.persistent) {
    int sms = 0, per_sm = 0;
    err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
    if (err != cudaSuccess) return (int)err;
    ctas = std::min(ctas, (long long)sms * std::max(per_sm, 1));
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((unsigned)ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  err = cudaLaunchKernelEx(&config, kernel, params...);
  return (int)(err != cudaSuccess ? err : cudaGetLastError());
}

// grouped_kernel, or grouped_kernel_tma where `ymap` is given (128-row tiles): the ring and its barriers (padded to
// 1 KB and the two output tiles after them with TMA stores), 1 KB to align the start. The CTA-per-tile kernel keeps
// its own code and shared memory: one kernel for both grids, TMA stores on a runtime flag (with or without the output
// tiles' memory on a CTA per tile), ran 3-15% slower on a CTA per tile (docs/performance.md).
template <int WN, int TW, int ST, typename T>
int launch(const CUtensorMap& wmap, const CUtensorMap& xmap, const CUtensorMap* ymap, const Args& a, Grid grid,
           cudaStream_t stream) {
  constexpr int STAGE = (64 * TW + WN) * BK, THREADS = 128 * TW + producer_threads(TW);
  if constexpr (TW == 2)
    if (ymap)
      return start<WN>(grouped_kernel_tma<WN, ST, T>, THREADS, ST * STAGE + 1024 + 2 * 64 * WN * 2 + 1024, a, grid,
                       stream, wmap, xmap, a, *ymap);
  return start<WN>(grouped_kernel<WN, TW, ST, T>, THREADS, ST * STAGE + 2 * ST * 8 + 1024, a, grid, stream, wmap, xmap,
                   a);
}

// f(std::integral_constant<int, ST>{}) for a ring depth of 2, 4 or 6
template <class F>
int by_stages(int stages, F f) {
  if (stages == 2) return f(std::integral_constant<int, 2>{});
  if (stages == 4) return f(std::integral_constant<int, 4>{});
  if (stages == 6) return f(std::integral_constant<int, 6>{});
  return (int)cudaErrorInvalidValue;
}

template <typename T>
int launch_config(const CUtensorMap& w, const CUtensorMap& x, const CUtensorMap* y, const Args& a, int tn, int wn,
                  int stages, Grid grid, cudaStream_t st) {
  auto go = [&](auto wn_, auto tw_) {
    return by_stages(stages,
                     [&](auto st_) { return launch<wn_.value, tw_.value, st_.value, T>(w, x, y, a, grid, st); });
  };
  using I64 = std::integral_constant<int, 64>;
  using I128 = std::integral_constant<int, 128>;
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  if (tn == 64 && wn == 64) return go(I64{}, I1{});
  if (tn == 64 && wn == 128) return go(I128{}, I1{});
  if (tn == 128 && wn == 64) return go(I64{}, I2{});
  if (tn == 128 && wn == 128) return go(I128{}, I2{});
  return (int)cudaErrorInvalidValue;
}

}  // namespace

namespace {

int grouped_gemm(const void* W, const void* S, long long s_expert, int s_stride, const void* XQ, const void* XS,
                 int ld_xs, int x_rows, const int* offsets, const int* dst, void* Y, int ldy, int y_fp16, int rows,
                 int E, int N, int K, int tn, int wn, int stages, int slots, int persistent, cudaStream_t st) {
  const int kblocks = (K + BK - 1) / BK;
  if (rows < 1 || rows > x_rows || x_rows > ld_xs || ld_xs % 4 || K % 16 || E < 1 || N < 1 || slots < 1)
    return (int)cudaErrorInvalidValue;
  CUtensorMap wmap, xmap;
  int err = make_map(&wmap, W, (long long)E * N, K, K, 64);
  if (!err) err = make_map(&xmap, XQ, x_rows, (long long)kblocks * BK, (long long)kblocks * BK, tn);
  if (err) return err;
  const Args a{(const float*)S, s_expert, s_stride, offsets, dst, (const float*)XS, ld_xs, Y, rows, E, N, kblocks,
               ldy};
  const Grid grid{slots, persistent};
  // TMA stores on the persistent grid of 128-row tiles where every row goes to its own place and Y's rows are 16-byte
  // aligned: Y's 16-bit elements as bytes [rows, 2N] in boxes of 64 rows by 128 bytes, the operands' swizzle
  CUtensorMap ymap;
  const bool tma_out = persistent && tn == 128 && !dst && (reinterpret_cast<uintptr_t>(Y) & 15) == 0 && ldy % 8 == 0 &&
                       make_map(&ymap, Y, rows, 2LL * N, 2LL * ldy, 64) == 0;
  const CUtensorMap* y = tma_out ? &ymap : nullptr;
  return y_fp16 ? launch_config<__half>(wmap, xmap, y, a, tn, wn, stages, grid, st)
                : launch_config<__nv_bfloat16>(wmap, xmap, y, a, tn, wn, stages, grid, st);
}

// token-tile slots that hold the tiles of any routing of `rows` rows over E experts (kernels/grouped/fp8.py's
// token_tile_slots, which a test holds it to through mxgemm_token_tile_slots): each of at most min(E + 1, rows)
// non-empty groups adds at most one partial tile
int token_tile_slots(long long rows, int E, int tn) {
  return (int)((rows + tn - 1) / tn + std::min<long long>(E + 1, rows));
}

// The routed block's scratch, each part 256-byte aligned: the sort's counts, offsets [E] and src [rows]; the gate/up
// input quantized (e4m3 [Sp, Kp1], scales [Kp1 / 128, Sp]); its output h [rows, 2I]; the down input quantized (e4m3
// [Sp, Kp2], scales [Kp2 / 128, Sp]); the down output y [rows, H] (rows = T * k copies, Sp rows rounded up to 4,
// Kp1 and Kp2 H and I rounded up to 128)
struct MoeSpace {
  size_t counts, offsets, src, xq, xs, h, pq, ps, y, bytes;
  long long rows, sp, kp1, kp2;
  MoeSpace(long long T, int k, int E, int H, int I, int elem) {
    rows = T * k, sp = (rows + 3) / 4 * 4, kp1 = (H + BK - 1) / BK * BK, kp2 = (I + BK - 1) / BK * BK;
    size_t at = 0;
    auto take = [&](long long bytes) {
      const size_t here = at;
      at += ((size_t)bytes + 255) / 256 * 256;
      return here;
    };
    counts = take((long long)moe::sort_blocks(rows) * (E + 1) * 4), offsets = take((long long)E * 4);
    src = take(rows * 4), xq = take(sp * kp1), xs = take(kp1 / BK * sp * 4), h = take(rows * 2 * I * elem);
    pq = take(sp * kp2), ps = take(kp2 / BK * sp * 4), y = take(rows * H * elem);
    bytes = at;
  }
};

template <typename T>
int moe_experts(const void* X, const void* ids, int ids_64, const void* weights, const void* W1, const void* S1,
                long long s1_expert, int s1_stride, const void* W2, const void* S2, long long s2_expert, int s2_stride,
                uint8_t* ws, void* out, long long T_, int k, int E, int H, int I, const int (&c1)[4],
                const int (&c2)[4], cudaStream_t st) {
  const MoeSpace m(T_, k, E, H, I, sizeof(T));
  const int rows = (int)m.rows, sp = (int)m.sp, kp1 = (int)m.kp1, kp2 = (int)m.kp2, fp16 = std::is_same_v<T, __half>;
  int* offsets = (int*)(ws + m.offsets);
  int* src = (int*)(ws + m.src);
  T* h = (T*)(ws + m.h);
  T* y = (T*)(ws + m.y);
  cudaError_t err = ids_64 ? moe::sort_by_expert((const long long*)ids, m.rows, E, (int*)(ws + m.counts), offsets, src, st)
                           : moe::sort_by_expert((const int*)ids, m.rows, E, (int*)(ws + m.counts), offsets, src, st);
  if (err != cudaSuccess) return (int)err;
  uint8_t* xq = ws + m.xq;
  float* xs = (float*)(ws + m.xs);
  if (sp / 4 * (kp1 / BK) >= QUANT_WIDE_FROM && kp1 % (4 * BK) == 0)  // launch_quant's choice of shape
    moe::gather_quant_kernel<T, 16><<<dim3(sp / 4, kp1 / (4 * BK)), 128, 0, st>>>((const T*)X, H, (int)T_, H, src, k,
                                                                               rows, xq, xs, sp, kp1);
  else
    moe::gather_quant_kernel<T, 4><<<dim3(sp / 4, kp1 / BK), 128, 0, st>>>((const T*)X, H, (int)T_, H, src, k, rows,
                                                                          xq, xs, sp, kp1);
  if ((err = cudaGetLastError()) != cudaSuccess) return (int)err;
  int e = grouped_gemm(W1, S1, s1_expert, s1_stride, xq, xs, sp, sp, offsets, nullptr, h, 2 * I, fp16,
                       rows, E, 2 * I, H, c1[0], c1[1], c1[2], token_tile_slots(rows, E, c1[0]), c1[3], st);
  if (e) return e;
  err = launch_quant<T, true>(h, 2 * I, h + I, 2 * I, rows, I, ws + m.pq, ws + m.ps, sp, kp2, st);
  if (err != cudaSuccess) return (int)err;
  e = grouped_gemm(W2, S2, s2_expert, s2_stride, ws + m.pq, ws + m.ps, sp, sp, offsets, src, y, H, fp16, rows, E, H,
                   I, c2[0], c2[1], c2[2], token_tile_slots(rows, E, c2[0]), c2[3], st);
  if (e) return e;
  moe::combine_kernel<T><<<dim3((unsigned)T_, (H + 2047) / 2048), 256, 0, st>>>(y, (const T*)weights, (T*)out, H, k);
  return (int)cudaGetLastError();
}

}  // namespace

// The entry points mxgemm calls through ctypes; each returns a cudaError_t (0: launched).
// mxgemm_grouped_fp8: W [E, N, K] e4m3 (row stride K, K % 16 == 0); S fp32 block scales (expert stride s_expert,
// 128-row block stride s_stride, unit stride along K); XQ [x_rows, Kp] e4m3 rows sorted by expert (Kp = 128 *
// ceil(K / 128), 16-byte aligned) and XS [Kp / 128, ld_xs] fp32 their scales (ld_xs % 4 == 0, x_rows <= ld_xs);
// offsets int32 [E]; dst int32 [rows] or null; Y [.., ldy] bf16 (y_fp16 = 0) or fp16; rows: the rows sorted by expert
// (<= x_rows); tn rows (64, 128) by wn weight rows (64, 128) per CTA; stages: ring depth (2, 4, 6); slots: token-tile
// slots that hold any routing's tiles; persistent: 0 for a CTA per slot and weight tile, else as many CTAs as fit on
// the GPU.
extern "C" int mxgemm_grouped_fp8(const void* W, const void* S, long long s_expert, int s_stride, const void* XQ,
                                  const void* XS, int ld_xs, int x_rows, const int* offsets, const int* dst, void* Y,
                                  int ldy, int y_fp16, int rows, int E, int N, int K, int tn, int wn, int stages,
                                  int slots, int persistent, void* stream) {
  return grouped_gemm(W, S, s_expert, s_stride, XQ, XS, ld_xs, x_rows, offsets, dst, Y, ldy, y_fp16, rows, E, N, K, tn,
                      wn, stages, slots, persistent, (cudaStream_t)stream);
}

// mxgemm_token_tile_slots: token_tile_slots, exported for the test that compares it with the Python launches' count
extern "C" int mxgemm_token_tile_slots(long long rows, int E, int tn) { return token_tile_slots(rows, E, tn); }

// mxgemm_moe_workspace: the bytes of scratch mxgemm_moe_experts takes for T tokens of k copies, E experts, hidden
// size H, expert width I and elem-byte activations
extern "C" long long mxgemm_moe_workspace(long long T, int k, int E, int H, int I, int elem) {
  return (long long)MoeSpace(T, k, E, H, I, elem).bytes;
}

// mxgemm_moe_experts: the routed block of a mixture of experts in seven launches (the Triton backend's wgmma path,
// the same bits): the copies sorted by expert (two), gathered and quantized, gate/up [E, 2I, H] (W1, S1) on them,
// silu(gate) * up quantized, down [E, H, I] (W2, S2) writing each copy to its token's place, the weighted sum. X [T, H]
// and weights [T, k] bf16 (fp16 = 0) or fp16, contiguous; ids [T, k] int64 (ids_64) or int32, contiguous; ws:
// mxgemm_moe_workspace bytes (256-byte aligned); out [T, H]; c1, c2: each GEMM's tn, wn, stages, persistent.
extern "C" int mxgemm_moe_experts(const void* X, const void* ids, int ids_64, const void* weights, const void* W1,
                                  const void* S1, long long s1_expert, int s1_stride, const void* W2, const void* S2,
                                  long long s2_expert, int s2_stride, void* ws, void* out, long long T, int k, int E,
                                  int H, int I, int fp16, int tn1, int wn1, int stages1, int persistent1, int tn2,
                                  int wn2, int stages2, int persistent2, void* stream) {
  if (T < 1 || k < 1 || E < 1 || H % 32 || I % 32 || T * k > INT_MAX / 2) return (int)cudaErrorInvalidValue;
  const int c1[4] = {tn1, wn1, stages1, persistent1}, c2[4] = {tn2, wn2, stages2, persistent2};
  const cudaStream_t st = (cudaStream_t)stream;
  return fp16 ? moe_experts<__half>(X, ids, ids_64, weights, W1, S1, s1_expert, s1_stride, W2, S2, s2_expert,
                                    s2_stride, (uint8_t*)ws, out, T, k, E, H, I, c1, c2, st)
              : moe_experts<__nv_bfloat16>(X, ids, ids_64, weights, W1, S1, s1_expert, s1_stride, W2, S2, s2_expert,
                                           s2_stride, (uint8_t*)ws, out, T, k, E, H, I, c1, c2, st);
}
