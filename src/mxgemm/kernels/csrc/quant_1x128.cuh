// The 1x128 activation quantizer of the FP8 GEMMs (the numerics of mxgemm.block128.quantize_1x128): the rule on a
// lane's values (quant_group, quant_values), what it reads (X, or the product a gated MLP feeds its down projection),
// its two kernels and their launch (launch_quant). Included by fp8_gemm.cu, whose fused kernels quantize with the
// same rule in shared memory.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "graph_launch.cuh"
#include "sm90.cuh"

// The product a gated MLP feeds its down projection, silu(g) * u, one element as PyTorch computes it in T (bf16,
// fp16): SiLU as g / (1 + exp(-g)) in fp32 (an IEEE division and expf), rounded to T, times u in fp32, rounded to T
// (the bits of torch.nn.functional.silu(g) * u). Returned in fp32, which holds it exactly.
template <typename T>
__device__ __forceinline__ float gated_value(float g, float u) {
  const float act = static_cast<float>(static_cast<T>(__fdiv_rn(g, __fadd_rn(1.f, expf(-g)))));
  return static_cast<float>(static_cast<T>(__fmul_rn(act, u)));
}

namespace {

using sm90::BK;

// quant_values: the 1x128 rule (bit-exact to mxgemm.block128.quantize_1x128) on one lane's N consecutive values of a 128-wide group
// held by LANES aligned consecutive lanes: amax floored at 2^-64, q = satfinite_e4m3(clamp(x * (448 / amax))) with
// IEEE divisions; the e4m3 bytes into `bits` (element i in byte i % 4 of word i / 4); returns amax / 448, the scale.
// quant_group: the same, given the lane's own max |v[i]| as `amax`.
template <int N, int LANES>
__device__ __forceinline__ float quant_group(const float (&v)[N], float amax, uint32_t (&bits)[N / 4]) {
#pragma unroll
  for (int off = LANES / 2; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  amax = fmaxf(amax, 0x1p-64f);
  const float inv = __fdiv_rn(448.f, amax);
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const float lo = fminf(fmaxf(__fmul_rn(v[i], inv), -448.f), 448.f);
    const float hi = fminf(fmaxf(__fmul_rn(v[i + 1], inv), -448.f), 448.f);
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    if (i % 4 == 0) bits[i / 4] = pair;
    else bits[i / 4] |= (uint32_t)pair << 16;
  }
  return __fdiv_rn(amax, 448.f);
}
template <int N, int LANES>
__device__ __forceinline__ float quant_values(const float (&v)[N], uint32_t (&bits)[N / 4]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(v[i]));
  return quant_group<N, LANES>(v, amax, bits);
}

// N consecutive values of row `row` from column `col` (a multiple of N; zeros past M and K, K % 32 == 0) as floats:
// one 8-byte load (N = 4) or two 16-byte loads (N = 16) where the rows are so aligned
template <typename T, int N>
__device__ __forceinline__ void load_values(const T* __restrict__ X, int ldx, int row, int col, int M, int K,
                                            float (&v)[N]) {
  static_assert(N == 4 || N == 16, "4 or 16 values");
  constexpr int ALIGN = N == 4 ? 8 : 16;  // bytes
  if (reinterpret_cast<uintptr_t>(X) % ALIGN == 0 && ldx % (ALIGN / 2) == 0 && row < M && col < K) {  // all inside K
    if constexpr (N == 4) {
      const uint2 raw = __ldg(reinterpret_cast<const uint2*>(X + (size_t)row * ldx + col));
      const T* t = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = static_cast<float>(t[i]);
    } else {
      const uint4* p = reinterpret_cast<const uint4*>(X + (size_t)row * ldx + col);
      const uint4 raw[2] = {__ldg(p), __ldg(p + 1)};
      const T* t = reinterpret_cast<const T*>(raw);
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = static_cast<float>(t[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = row < M && col + i < K ? static_cast<float>(X[(size_t)row * ldx + col + i]) : 0.f;
  }
}

// The values a quantizer takes: X's, or (GATED) the product a gated MLP feeds its down projection, silu(X) * U
// (gated_value)
template <typename T, bool GATED, int N>
__device__ __forceinline__ void input_values(const T* __restrict__ X, int ldx, const T* __restrict__ U, int ldu,
                                             int row, int col, int M, int K, float (&v)[N]) {
  load_values<T, N>(X, ldx, row, col, M, K, v);
  if constexpr (GATED) {
    float u[N];
    load_values<T, N>(U, ldu, row, col, M, K, u);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = gated_value<T>(v[i], u[i]);
  }
}

// gated_value's bits for 16 consecutive bf16 elements of a row (16-byte aligned, inside M and K) on bf16 pairs: SiLU
// rounded two at a time, the product by mul.rn.bf16x2 and |.| with max on pairs (max.bf16x2, as fmaxf, returns the
// operand that is not NaN). Two bf16 values' product is exact in fp32 but where it is subnormal there, so one rounding
// gives gated_value's bits but for products below 2^-126, which any 128-group's scale (its amax floored at 2^-64)
// quantizes to a zero of the same sign either way. The products into v, their max |.| returned.
// (T is bf16; the fp16 kernels compile the call out.)
template <typename T>
__device__ __forceinline__ float gated_pairs16(const T* __restrict__ G, int ldg, const T* __restrict__ U, int ldu,
                                               int row, int col, float (&v)[16]) {
  const uint4* gp = reinterpret_cast<const uint4*>(G + (size_t)row * ldg + col);
  const uint4* up = reinterpret_cast<const uint4*>(U + (size_t)row * ldu + col);
  const uint4 graw[2] = {__ldg(gp), __ldg(gp + 1)}, uraw[2] = {__ldg(up), __ldg(up + 1)};
  const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(graw);
  const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(uraw);
  __nv_bfloat162 amax2 = __floats2bfloat162_rn(0.f, 0.f);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 g = __bfloat1622float2(g2[i]);
    const float a0 = __fdiv_rn(g.x, __fadd_rn(1.f, expf(-g.x))), a1 = __fdiv_rn(g.y, __fadd_rn(1.f, expf(-g.y)));
    const __nv_bfloat162 p = __hmul2(__floats2bfloat162_rn(a0, a1), u2[i]);
    amax2 = __hmax2(amax2, __habs2(p));
    const float2 f = __bfloat1622float2(p);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
  return fmaxf(__low2float(amax2), __high2float(amax2));
}

// The 1x128 activation quantizer (quant_values' rule), in two shapes with the same bits, of X or (GATED) of the
// product act(X) * U (input_values). Both write the scales K-group-major ([Kp/128, Mp]) and zeros in rows past M and
// columns past K (K % 32 == 0).
//
// quant_1x128_kernel: a warp per row and 128-wide K group, 4 elements a lane (one 8-byte load where rows are 8-byte
// aligned). It lets the GEMM launched after it as a programmatic dependent start at once, to load its first weight
// tiles meanwhile: for grids of less than two waves, where the GEMM's waiting CTAs take no SMs its blocks need.
template <typename T, bool GATED>
__global__ void __launch_bounds__(128) quant_1x128_kernel(const T* __restrict__ X, int ldx, const T* __restrict__ U,
                                                          int ldu, int M, int K, uint32_t* __restrict__ Q,
                                                          float* __restrict__ XS, int Mp, int Kp) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int row = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = blockIdx.y * BK + 4 * lane;
  float v[4];
  input_values<T, GATED>(X, ldx, U, ldu, row, col, M, K, v);
  uint32_t bits[1];
  const float scale = quant_values<4, 32>(v, bits);
  Q[((size_t)row * Kp + col) / 4] = bits[0];
  if (lane == 0) XS[(size_t)blockIdx.y * Mp + row] = scale;
}

// quant_1x128_wide_kernel, for grids of several waves (prefill), where the rule's arithmetic and not the bytes set
// the pace of the one-group warp: a warp per row and four consecutive K groups, 8 lanes a group and 16 elements a
// lane (two 16-byte loads where rows are 16-byte aligned), so that a group costs 3 shuffle steps and two divisions
// per 16 elements instead of 5 and two per 4; the bf16 gated product on pairs (gated_pairs16). The GEMM after it starts
// as its blocks finish.
template <typename T, bool GATED>
__global__ void __launch_bounds__(128) quant_1x128_wide_kernel(const T* __restrict__ X, int ldx,
                                                               const T* __restrict__ U, int ldu, int M, int K,
                                                               uint4* __restrict__ Q, float* __restrict__ XS, int Mp,
                                                               int Kp) {
  const int row = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = blockIdx.y * 4 + lane / 8;
  const int col = group * BK + 16 * (lane % 8);
  float v[16];
  uint32_t bits[4];
  float scale;
  constexpr bool PAIRS = GATED && std::is_same_v<T, __nv_bfloat16>;
  if (PAIRS && row < M && col < K && reinterpret_cast<uintptr_t>(X) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(U) % 16 == 0 && ldx % 8 == 0 && ldu % 8 == 0) {
    scale = quant_group<16, 8>(v, gated_pairs16(X, ldx, U, ldu, row, col, v), bits);
  } else {
    input_values<T, GATED>(X, ldx, U, ldu, row, col, M, K, v);
    scale = quant_values<16, 8>(v, bits);
  }
  Q[((size_t)row * Kp + col) / 16] = make_uint4(bits[0], bits[1], bits[2], bits[3]);
  if (lane % 8 == 0) XS[(size_t)group * Mp + row] = scale;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// The wide quantizer from this many one-group blocks (two waves of them at 16 blocks an SM)
constexpr int QUANT_WIDE_FROM = 4096;

template <typename T, bool GATED = false>
cudaError_t launch_quant(const void* X, int ldx, const void* U, int ldu, int M, int K, void* XQ, void* XS, int Mp,
                         int Kp, cudaStream_t st) {
  const bool wide = Mp / 4 * (Kp / BK) >= QUANT_WIDE_FROM && Kp % (4 * BK) == 0;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(Mp / 4, Kp / ((wide ? 4 : 1) * BK));
  config.blockDim = dim3(128);
  config.stream = st;
  using graph_launch::launch_or_record;
  return wide ? launch_or_record(quant_1x128_wide_kernel<T, GATED>, config, (const T*)X, ldx, (const T*)U, ldu, M, K,
                                 (uint4*)XQ, (float*)XS, Mp, Kp)
              : launch_or_record(quant_1x128_kernel<T, GATED>, config, (const T*)X, ldx, (const T*)U, ldu, M, K,
                                 (uint32_t*)XQ, (float*)XS, Mp, Kp);
}

}  // namespace
