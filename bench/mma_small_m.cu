// Exploration (bench/explore_mma_small_m.py): small-M GEMM y[M, N] = x[M, K] @ W^T for a 128x128-block-scaled FP8
// weight (the hybrid_sm90 weight), on mma.sync tensor cores with the weight decoded in registers.
//
// Swap-AB: W rows are the MMA's M dimension (16 per tile), tokens its N dimension (8 per tile, NT tiles). Each lane
// loads 16 contiguous weight bytes of row g and of row g + 8 per 64-wide K chunk (LDG.128) and feeds them to four
// m16n8k16 MMAs. The K order inside the dot product is free, so lane t's 16 bytes are assigned to the MMA's logical
// K slots {2t, 2t+1, 2t+8, 2t+9} of four consecutive steps, and the activations are loaded with the same assignment.
//
// DECODE 0 (bf16): e4m3 bits are placed into bf16 bits (sign, then exponent/mantissa shifted by 4): the bf16 value
//   is w * 2^-120 exactly, subnormals included; activations are pre-scaled by 2^64 (exact unless |x| >= 2^64), and
//   the block scale is multiplied by 2^56 at the end.
// DECODE 1 (f16): cvt.rn.f16x2.e4m3x2 (exact); activations converted to f16 (exact only inside the f16 range).
//
// CTA: 4 warps, each a K slice of KSLICE of the same RT row tiles; the 4 partials are reduced in shared memory in a
// fixed order. grid.y splits K further: fp32 partials in a workspace, summed in order by a second kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace mma_small_m {

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// bf16 bit pattern of (e4m3 byte) * 2^-120 for bytes 0,1 (lo) and 2,3 (hi) of w
__device__ __forceinline__ void decode_bf16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  uint32_t nib = (w << 4) & 0xf0f0f0f0u;                          // low nibble -> high nibble of its byte
  uint32_t top = ((w >> 4) & 0x07070707u) | (w & 0x80808080u);     // exponent bits 4..6 -> 0..2, sign kept
  lo = prmt(nib, top, 0x5140);                                     // [nib.b0, top.b0, nib.b1, top.b1]
  hi = prmt(nib, top, 0x7362);                                     // [nib.b2, top.b2, nib.b3, top.b3]
}

__device__ __forceinline__ void decode_f16(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(lo), "=r"(hi) : "r"(w));
}

template <int DECODE>
__device__ __forceinline__ void mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  if constexpr (DECODE == 0) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// activations: 8 consecutive bf16 (one uint4) -> 4 B-operand registers of the decode's type
template <int DECODE>
__device__ __forceinline__ void stage_x(uint4 v, uint32_t* out) {
  uint32_t in[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&in[i]);
    float2 f = __bfloat1622float2(b);
    if constexpr (DECODE == 0) {
      __nv_bfloat162 s = __floats2bfloat162_rn(f.x * 18446744073709551616.0f, f.y * 18446744073709551616.0f);
      out[i] = *reinterpret_cast<uint32_t*>(&s);
    } else {
      __half2 h = __floats2half2_rn(f.x, f.y);
      out[i] = *reinterpret_cast<uint32_t*>(&h);
    }
  }
}

// W [Np, Kp] uint8 (Np % 16 == 0, Kp == 4 * KSLICE * kiters * gridDim.y), S fp32 [Np/128, s_stride] block scales,
// X bf16 [M, K] row-major (K % 16 == 0), out: bf16 Y [M, ldy] when gridDim.y == 1, else fp32 WS [gridDim.y, M, Np].
template <int NT, int RT, int KSLICE, int DECODE>
__global__ void __launch_bounds__(128) gemm_small_m(const uint8_t* __restrict__ W, const float* __restrict__ S,
                                                    int s_stride, const __nv_bfloat16* __restrict__ X, int M, int K,
                                                    int N, int Np, int Kp, int kiters, __nv_bfloat16* __restrict__ Y,
                                                    int ldy, float* __restrict__ WS) {
  constexpr int CHUNKS = KSLICE / 64;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * (16 * RT);
  float acc[RT][NT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.f;

  for (int it = 0; it < kiters; ++it) {
    const int k0 = ((blockIdx.y * kiters + it) * 4 + warp) * KSLICE;

    // all weight loads of this warp's task first: RT tiles x CHUNKS chunks x rows g, g+8
    uint4 wv[RT][CHUNKS][2];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint8_t* p = W + (size_t)(row0 + 16 * r + g + 8 * h) * Kp + k0 + 64 * c + 16 * t;
          wv[r][c][h] = __ldg(reinterpret_cast<const uint4*>(p));
        }

    // activations of this K slice for NT token tiles: 16 values per lane per chunk, in the same K assignment
    uint32_t xb[NT][CHUNKS][8];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < CHUNKS; ++c) {
        const int m = 8 * n + g, k = k0 + 64 * c + 16 * t;
        uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
        if (m < M && k < K) {
          const uint4* p = reinterpret_cast<const uint4*>(X + (size_t)m * K + k);
          v0 = __ldg(p);
          v1 = __ldg(p + 1);
        }
        stage_x<DECODE>(v0, &xb[n][c][0]);
        stage_x<DECODE>(v1, &xb[n][c][4]);
      }

#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const float* srow = S + (size_t)((row0 + 16 * r) / 128) * s_stride;
#pragma unroll
      for (int kb = 0; kb < CHUNKS / 2; ++kb) {  // one 128-deep block: one scale
        float part[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) part[n][i] = 0.f;
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const int c = 2 * kb + cc;
          const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&wv[r][c][0]);
          const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&wv[r][c][1]);
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            uint32_t a0, a2, a1, a3;
            if constexpr (DECODE == 0) {
              decode_bf16(w0[s], a0, a2);
              decode_bf16(w1[s], a1, a3);
            } else {
              decode_f16(w0[s], a0, a2);
              decode_f16(w1[s], a1, a3);
            }
#pragma unroll
            for (int n = 0; n < NT; ++n) mma<DECODE>(part[n], a0, a1, a2, a3, xb[n][c][2 * s], xb[n][c][2 * s + 1]);
          }
        }
        float sc = __ldg(srow + (k0 + 128 * kb) / 128);
        if constexpr (DECODE == 0) sc *= 72057594037927936.0f;  // 2^56 = 2^120 / 2^64
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[r][n][i] = fmaf(sc, part[n][i], acc[r][n][i]);
      }
    }
  }

  // reduce the 4 warps (4 K slices) in a fixed order
  __shared__ float red[4][RT * NT * 4][32];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][(r * NT + n) * 4 + i][lane] = acc[r][n][i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = (r * NT + n) * 4 + i;
        float v = ((red[0][j][lane] + red[1][j][lane]) + red[2][j][lane]) + red[3][j][lane];
        const int row = row0 + 16 * r + g + 8 * (i / 2), m = 8 * n + 2 * t + (i % 2);
        if (m >= M) continue;
        if (gridDim.y == 1) {
          if (row < N) Y[(size_t)m * ldy + row] = __float2bfloat16_rn(v);
        } else {
          WS[((size_t)blockIdx.y * M + m) * Np + row] = v;
        }
      }
}

__global__ void sum_splits(const float* __restrict__ WS, int splits, int M, int N, int Np,
                           __nv_bfloat16* __restrict__ Y, int ldy) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= M * N) return;
  const int m = idx / N, n = idx % N;
  float v = 0.f;
  for (int s = 0; s < splits; ++s) v += WS[((size_t)s * M + m) * Np + n];
  Y[(size_t)m * ldy + n] = __float2bfloat16_rn(v);
}

}  // namespace mma_small_m

// ctypes entry point (no torch headers: builds in seconds). Returns the launch's cudaError_t.
template <int NT, int RT, int KS, int D>
static int launch(const void* W, const void* S, int s_stride, const void* X, void* Y, int ldy, void* WS, int M, int K,
                  int N, int Np, int Kp, int splits, cudaStream_t st) {
  using namespace mma_small_m;
  const int kiters = Kp / (4 * KS) / splits;
  if (kiters * 4 * KS * splits != Kp || Np % (16 * RT) != 0) return (int)cudaErrorInvalidValue;
  dim3 grid(Np / (16 * RT), splits);
  gemm_small_m<NT, RT, KS, D><<<grid, 128, 0, st>>>(
      (const uint8_t*)W, (const float*)S, s_stride, (const __nv_bfloat16*)X, M, K, N, Np, Kp, kiters,
      (__nv_bfloat16*)Y, ldy, (float*)WS);
  if (splits > 1)
    sum_splits<<<(M * N + 255) / 256, 256, 0, st>>>((const float*)WS, splits, M, N, Np, (__nv_bfloat16*)Y, ldy);
  return (int)cudaGetLastError();
}

extern "C" int mma_small_m_run(const void* W, const void* S, int s_stride, const void* X, void* Y, int ldy, void* WS,
                               int M, int K, int N, int Np, int Kp, int nt, int rt, int ks, int decode, int splits,
                               void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
#define MMA_CASE(a, b, c, d)                        \
  if (nt == a && rt == b && ks == c && decode == d) \
    return launch<a, b, c, d>(W, S, s_stride, X, Y, ldy, WS, M, K, N, Np, Kp, splits, st);
#define MMA_CASES_D(a, b, c) MMA_CASE(a, b, c, 0) MMA_CASE(a, b, c, 1)
#define MMA_CASES_K(a, b) MMA_CASES_D(a, b, 128) MMA_CASES_D(a, b, 256)
#define MMA_CASES_R(a) MMA_CASES_K(a, 1) MMA_CASES_K(a, 2) MMA_CASES_K(a, 4)
  MMA_CASES_R(1)
  MMA_CASES_R(2)
  return (int)cudaErrorInvalidValue;
}
