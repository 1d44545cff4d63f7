// mxgemm small-M kernel: y[M, N] = x[M, K] @ W^T for M <= 16, W a 128x128-block-scaled FP8 E4M3 weight (the
// hybrid_sm90 weight: uint8 [Np, Kp], Np % 16 == 0, Kp % 512 == 0; fp32 block scales [>= Np/128, Kp/128]).
// Exact with respect to that weight: products in the tensor cores, fp32 accumulation, bf16 output.
//
// Swap-AB on mma.sync.m16n8k16 (bf16): weight rows are the MMA's M (16 per tile), tokens its N (8 per tile, NT
// tiles). Per 64-wide K chunk each lane loads 16 contiguous weight bytes of row g and of row g + 8 (LDG.128) and
// feeds them to four MMAs: the K order inside a dot product is free, so lane t's bytes take the MMA's logical K
// slots {2t, 2t+1, 2t+8, 2t+9} of four consecutive steps, and the activations are loaded with the same assignment.
//
// Decode in registers: e4m3 bits moved into bf16 bits give w * 2^-120 exactly (subnormals included); activations
// are scaled by 2^64 (exact for |x| < 2^64) and each 128-deep block's partial sum by scale * 2^56.
//
// CTA: 4 warps, each a 128-deep K slice of the same RT row tiles, `kiters` times; the 4 partials are reduced in
// shared memory in a fixed order. gridDim.y splits K further: fp32 partials in a workspace [splits, M, Np], summed
// in order by a second kernel. Deterministic.
#include <cuda_bf16.h>
#include <stdint.h>

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

template <int NT, int RT>
__global__ void __launch_bounds__(128) small_m_kernel(const uint8_t* __restrict__ W, const float* __restrict__ S,
                                                      int s_stride, const __nv_bfloat16* __restrict__ X, int M, int K,
                                                      int N, int Kp, int kiters, __nv_bfloat16* __restrict__ Y,
                                                      int ldy, float* __restrict__ WS, int Np) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * (16 * RT);
  float acc[RT][NT][4] = {};

  for (int it = 0; it < kiters; ++it) {
    const int k0 = ((blockIdx.y * kiters + it) * 4 + warp) * KS;
    uint4 wv[RT][2][2];  // row tile, 64-chunk, row g / g + 8
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wv[r][c][h] = __ldg(reinterpret_cast<const uint4*>(W + (size_t)(row0 + 16 * r + g + 8 * h) * Kp + k0 +
                                                             64 * c + 16 * t));
    uint32_t xb[NT][2][8];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int m = 8 * n + g, k = k0 + 64 * c + 16 * t;
        uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0;
        if (m < M && k < K) {
          const uint4* p = reinterpret_cast<const uint4*>(X + (size_t)m * K + k);
          v0 = __ldg(p);
          v1 = __ldg(p + 1);
        }
        stage_x(v0, &xb[n][c][0]);
        stage_x(v1, &xb[n][c][4]);
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
      const float sc = __ldg(S + (size_t)((row0 + 16 * r) / 128) * s_stride + k0 / KS) * 72057594037927936.0f;
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[r][n][i] = fmaf(sc, part[n][i], acc[r][n][i]);
    }
  }

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
        const float v = ((red[0][j][lane] + red[1][j][lane]) + red[2][j][lane]) + red[3][j][lane];
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

template <int NT, int RT>
int launch(const void* W, const void* S, int s_stride, const void* X, void* Y, int ldy, void* WS, int M, int K,
           int N, int Np, int Kp, int splits, cudaStream_t st) {
  const int kiters = Kp / (4 * KS) / splits;
  if (kiters < 1 || kiters * 4 * KS * splits != Kp || Np % (16 * RT) != 0) return (int)cudaErrorInvalidValue;
  small_m_kernel<NT, RT><<<dim3(Np / (16 * RT), splits), 128, 0, st>>>(
      (const uint8_t*)W, (const float*)S, s_stride, (const __nv_bfloat16*)X, M, K, N, Kp, kiters,
      (__nv_bfloat16*)Y, ldy, (float*)WS, Np);
  if (splits > 1)
    sum_splits<<<(M * N + 255) / 256, 256, 0, st>>>((const float*)WS, splits, M, N, Np, (__nv_bfloat16*)Y, ldy);
  return (int)cudaGetLastError();
}

}  // namespace

// The entry point mxgemm calls through ctypes; returns the launch's cudaError_t (0: launched).
extern "C" int mxgemm_small_m(const void* W, const void* S, int s_stride, const void* X, void* Y, int ldy, void* WS,
                              int M, int K, int N, int Np, int Kp, int rt, int splits, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  if (M < 1 || M > 16) return (int)cudaErrorInvalidValue;
  if (M <= 8) {
    return rt == 2 ? launch<1, 2>(W, S, s_stride, X, Y, ldy, WS, M, K, N, Np, Kp, splits, st)
                   : launch<1, 1>(W, S, s_stride, X, Y, ldy, WS, M, K, N, Np, Kp, splits, st);
  }
  return rt == 2 ? launch<2, 2>(W, S, s_stride, X, Y, ldy, WS, M, K, N, Np, Kp, splits, st)
                 : launch<2, 1>(W, S, s_stride, X, Y, ldy, WS, M, K, N, Np, Kp, splits, st);
}
