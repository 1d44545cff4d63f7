// mxgemm small-M kernel: y[M, N] = x[M, K] @ W^T for M <= 16, W a 128x128-block-scaled FP8 E4M3 weight (the
// hybrid_sm90 weight: uint8 [Np, Kp], Np % 16 == 0, Kp % 512 == 0; fp32 block scales [>= Np/128, Kp/128]).
// Exact with respect to that weight: products in the tensor cores, fp32 accumulation, bf16 output.
//
// Swap-AB on mma.sync.m16n8k16 (bf16): weight rows are the MMA's M (16 per tile), tokens its N (8 per tile, NT
// tiles). Per 64-wide K chunk each lane takes 16 contiguous weight bytes of row g and of row g + 8 and feeds them
// to four MMAs: the K order inside a dot product is free, so lane t's bytes take the MMA's logical K
// slots {2t, 2t+1, 2t+8, 2t+9} of four consecutive steps, and the activations are loaded with the same assignment.
//
// Decode in registers: e4m3 bits moved into bf16 bits give w * 2^-120 exactly (subnormals included); activations
// are scaled by 2^64 (exact for |x| < 2^64) and each 128-deep block's partial sum by scale * 2^56.
//
// Loads: each warp streams its weight bytes through a private ring of ST (2, 3) shared-memory stages filled by
// cp.async, ST - 1 slices ahead; every lane copies and reads back only its own 16-byte chunks, so lanes never wait
// on each other. Activations and scales of the next slice are loaded one iteration ahead into registers.
// CTA: 4 warps, each a 128-deep K slice of the same RT row tiles, `kiters` times; the 4 partials are reduced in
// shared memory in a fixed order. gridDim.y (<= 8) splits K further: those CTAs form one thread-block cluster and
// rank 0 adds the other ranks' partials from distributed shared memory in rank order. Deterministic; one launch.
// Measured on the H200: the ring beats loads into registers, and the cluster sum beats an
// fp32 workspace summed by a second kernel.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "graph_launch.cuh"

namespace cg = cooperative_groups;

namespace {

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// bf16 bits of (e4m3 byte) * 2^-120 for bytes 0,1 (lo) and 2,3 (hi) of w
__device__ __forceinline__ void decode(uint32_t w, uint32_t& lo, uint32_t& hi) {
  uint32_t nib = (w << 4) & 0xf0f0f0f0u;                       // mantissa + low exponent bit -> high nibble
  uint32_t top = ((w >> 4) & 0x07070707u) | (w & 0x80808080u);  // exponent bits 4..6 -> 0..2, sign kept
  lo = prmt(nib, top, 0x5140);                                  // [nib.b0, top.b0, nib.b1, top.b1]
  hi = prmt(nib, top, 0x7362);                                  // [nib.b2, top.b2, nib.b3, top.b3]
}

__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 8 consecutive bf16 activations (one uint4) -> 4 B-operand registers, scaled by 2^64
__device__ __forceinline__ void stage_x(uint4 v, uint32_t* out) {
  uint32_t in[4] = {v.x, v.y, v.z, v.w};
  const __nv_bfloat162 two64 = __floats2bfloat162_rn(18446744073709551616.0f, 18446744073709551616.0f);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 s = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&in[i]), two64);
    out[i] = *reinterpret_cast<uint32_t*>(&s);
  }
}

constexpr int KS = 128;  // K slice of one warp per iteration: one scale block

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

struct Args {
  const uint8_t* W;
  const float* S;
  int s_stride;
  const __nv_bfloat16* X;
  int M, K, N, Np, Kp, kiters;
  __nv_bfloat16* Y;
  int ldy;
  const __nv_bfloat16* bias;  // [N] added in fp32 before the output's one rounding; null: none
};

// this lane's 16 activations per 64-chunk of the warp's K slice at k0 (zeros past M or K)
template <int NT>
__device__ __forceinline__ void load_x(const Args& a, int k0, int g, int t, uint4 (&xr)[NT][2][2]) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int m = 8 * n + g, k = k0 + 64 * c + 16 * t;
      xr[n][c][0] = xr[n][c][1] = make_uint4(0, 0, 0, 0);
      if (m < a.M && k < a.K) {
        const uint4* p = reinterpret_cast<const uint4*>(a.X + (size_t)m * a.K + k);
        xr[n][c][0] = __ldg(p);
        xr[n][c][1] = __ldg(p + 1);
      }
    }
}

template <int RT>
__device__ __forceinline__ void load_scales(const Args& a, int row0, int k0, float (&sc)[RT]) {
#pragma unroll
  for (int r = 0; r < RT; ++r) sc[r] = __ldg(a.S + (size_t)((row0 + 16 * r) / 128) * a.s_stride + k0 / KS);
}

// one 128-deep slice: RT row tiles x NT token tiles of MMAs, scaled into the accumulators
template <int NT, int RT>
__device__ __forceinline__ void slice_mma(const uint4 (&wv)[RT][2][2], const uint4 (&xr)[NT][2][2],
                                          const float (&sc)[RT], float (&acc)[RT][NT][4]) {
  uint32_t xb[NT][2][8];
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      stage_x(xr[n][c][0], &xb[n][c][0]);
      stage_x(xr[n][c][1], &xb[n][c][4]);
    }
#pragma unroll
  for (int r = 0; r < RT; ++r) {
    float part[NT][4] = {};
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&wv[r][c][0]);
      const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&wv[r][c][1]);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        uint32_t a0, a1, a2, a3;
        decode(w0[s], a0, a2);
        decode(w1[s], a1, a3);
#pragma unroll
        for (int n = 0; n < NT; ++n) mma(part[n], a0, a1, a2, a3, xb[n][c][2 * s], xb[n][c][2 * s + 1]);
      }
    }
    const float s56 = sc[r] * 72057594037927936.0f;
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][n][i] = fmaf(s56, part[n][i], acc[r][n][i]);
  }
}

template <int NT, int RT, int ST>
__global__ void __launch_bounds__(128) small_m_kernel(const Args a) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * (16 * RT);
  auto k_of = [&](int it) { return ((blockIdx.y * a.kiters + it) * 4 + warp) * KS; };
  float acc[RT][NT][4] = {};

  constexpr int CH = RT * 4;  // 16-byte chunks per lane per stage: row tile r, 64-chunk c, row g + 8h
  extern __shared__ uint4 ring[];
  uint4* mine = ring + (size_t)warp * ST * CH * 32 + lane;
  auto issue = [&](int it) {
    if (it < a.kiters) {
      const int k0 = k_of(it);
      uint4* slot = mine + (it % ST) * CH * 32;
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            cp_async16(slot + ((r * 2 + c) * 2 + h) * 32,
                       a.W + (size_t)(row0 + 16 * r + g + 8 * h) * a.Kp + k0 + 64 * c + 16 * t);
    }
    cp_async_commit();  // an empty group past the end keeps the count uniform
  };
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) issue(s);
  uint4 xr[NT][2][2];
  float sc[RT];
  load_x<NT>(a, k_of(0), g, t, xr);
  load_scales<RT>(a, row0, k_of(0), sc);
  for (int it = 0; it < a.kiters; ++it) {
    issue(it + ST - 1);  // into the slot read, and used by the MMAs, in the previous iteration
    uint4 xn[NT][2][2];
    float sn[RT];
    const int kn = k_of(it + 1 < a.kiters ? it + 1 : it);
    load_x<NT>(a, kn, g, t, xn);
    load_scales<RT>(a, row0, kn, sn);
    cp_async_wait<ST - 1>();  // this iteration's slice has landed
    const uint4* slot = mine + (it % ST) * CH * 32;
    uint4 wv[RT][2][2];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) wv[r][c][h] = slot[((r * 2 + c) * 2 + h) * 32];
    slice_mma<NT, RT>(wv, xr, sc, acc);
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) xr[n][c][0] = xn[n][c][0], xr[n][c][1] = xn[n][c][1];
#pragma unroll
    for (int r = 0; r < RT; ++r) sc[r] = sn[r];
  }

  // the 4 warps' partials, summed by warp 0 in a fixed order; then, across the cluster of gridDim.y CTAs that split
  // K, rank 0 adds every other rank's partial from distributed shared memory in rank order
  constexpr int J = RT * NT * 4;
  __shared__ float red[4][J][32];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][(r * NT + n) * 4 + i][lane] = acc[r][n][i];
  __syncthreads();
  float v[J];
  if (warp == 0) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      v[j] = ((red[0][j][lane] + red[1][j][lane]) + red[2][j][lane]) + red[3][j][lane];
      red[0][j][lane] = v[j];  // each lane rewrites only what it read
    }
  }
  if (gridDim.y > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every rank's partial is in its shared memory
    if (cluster.block_rank() == 0 && warp == 0) {
      for (unsigned int rank = 1; rank < cluster.num_blocks(); ++rank) {
        const float* other = cluster.map_shared_rank(&red[0][0][0], rank);
#pragma unroll
        for (int j = 0; j < J; ++j) v[j] += other[j * 32 + lane];
      }
    }
    cluster.sync();  // no rank leaves while rank 0 may still read its shared memory
    if (cluster.block_rank() != 0) return;
  }
  if (warp != 0) return;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + 16 * r + g + 8 * (i / 2), m = 8 * n + 2 * t + (i % 2);
        if (m < a.M && row < a.N)
          a.Y[(size_t)m * a.ldy + row] =
              __float2bfloat16_rn(v[(r * NT + n) * 4 + i] + (a.bias ? __bfloat162float(a.bias[row]) : 0.f));
      }
}

// one launch of `Kernel` on a grid whose gridDim.y K splits form one thread-block cluster
template <auto Kernel>
int launch_clustered(const Args& a, dim3 grid, int threads, int smem, cudaStream_t st) {
  // ring + static shared memory may pass the default 48 KB: the kernel's limit is raised once per device (a repeated
  // call in a race is harmless)
  constexpr int kMaxDevices = 64;
  static bool raised[kMaxDevices] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return (int)err;
  if (device >= kMaxDevices || !raised[device]) {
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return (int)err;
    if (device < kMaxDevices) raised[device] = true;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = grid.y;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  err = graph_launch::launch_or_record(Kernel, config, a);
  return (int)(err != cudaSuccess ? err : cudaGetLastError());
}

template <int NT, int RT, int ST>
int launch(Args a, int splits, cudaStream_t st) {
  a.kiters = a.Kp / (4 * KS) / splits;
  if (a.kiters < 1 || a.kiters * 4 * KS * splits != a.Kp || a.Np % (16 * RT) != 0 || splits > 8)
    return (int)cudaErrorInvalidValue;
  const int smem = ST * RT * 4 * 32 * 16 * 4;  // the 4 warps' rings (one size per instantiation)
  return launch_clustered<small_m_kernel<NT, RT, ST>>(a, dim3(a.Np / (16 * RT), splits), 128, smem, st);
}

template <int NT, int RT>
int launch_st(const Args& a, int splits, int stages, cudaStream_t st) {
  if (stages == 2) return launch<NT, RT, 2>(a, splits, st);
  if (stages == 3) return launch<NT, RT, 3>(a, splits, st);
  return (int)cudaErrorInvalidValue;
}

}  // namespace

// The entry point mxgemm calls through ctypes; returns the launch's cudaError_t (0: launched).
// rt: row tiles per CTA (1, 2); splits: K splits, one cluster (1-8); stages: the ring's depth (2, 3).
// bias: bf16 [N] or null.
extern "C" int mxgemm_small_m(const void* W, const void* S, int s_stride, const void* X, const void* bias, void* Y,
                              int ldy, int M, int K, int N, int Np, int Kp, int rt, int splits, int stages,
                              void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (M < 1 || M > 16 || (rt != 1 && rt != 2)) return (int)cudaErrorInvalidValue;
  const Args a{(const uint8_t*)W, (const float*)S, s_stride, (const __nv_bfloat16*)X, M, K, N, Np, Kp, 0,
               (__nv_bfloat16*)Y, ldy, (const __nv_bfloat16*)bias};
  if (M <= 8) return rt == 2 ? launch_st<1, 2>(a, splits, stages, st) : launch_st<1, 1>(a, splits, stages, st);
  return rt == 2 ? launch_st<2, 2>(a, splits, stages, st) : launch_st<2, 1>(a, splits, stages, st);
}

// What mxgemm_small_m_run takes besides the call's pointers: everything fixed for one weight, config and M (one
// ctypes argument instead of a dozen: each costs host time on every call); the output's row stride is N.
// `graphed`: outside stream capture, launch as a CUDA graph (`graph`: graph_launch.cuh; freed by
// mxgemm_small_m_plan_free).
struct SmallMPlan {
  const void* W;
  const void* S;
  int s_stride, M, K, N, Np, Kp, rt, splits, stages;
  void* graph;
  int graphed, reserved;
};
static_assert(sizeof(SmallMPlan) == 72, "small_m._Plan mirrors this layout");

extern "C" int mxgemm_small_m_run(SmallMPlan* p, const void* X, const void* bias, void* Y, void* stream) {
  auto launch = [&](cudaStream_t s) {
    return mxgemm_small_m(p->W, p->S, p->s_stride, X, bias, Y, p->N, p->M, p->K, p->N, p->Np, p->Kp, p->rt,
                          p->splits, p->stages, s);
  };
  if (p->graphed) {
    const int err = graph_launch::run_as_graph(&p->graph, launch, (cudaStream_t)stream);
    if (err != graph_launch::kNotGraphed) return err;
  }
  return launch((cudaStream_t)stream);
}

// Frees what a plan made (its graph); the plan's memory is its owner's
extern "C" void mxgemm_small_m_plan_free(SmallMPlan* p) { graph_launch::free_plan_graph(&p->graph); }
