// A variant of the gated 1x128 quantizer (bench/explore/quant_lab.py), the product's kernel file included for its
// helpers: the product's wide shape (a warp per row and four K groups, 16 elements a lane), bf16 only, with the
// product silu(g) * u and its amax computed on bf16 pairs: act rounded two at a time (cvt.rn.bf16x2.f32), the product
// by mul.rn.bf16x2 (two bf16 values' fp32 product is exact, so one rounding gives the fp32 product's bf16 bits but
// where that product is subnormal in fp32), |.| and max on pairs (max.bf16x2, as fmaxf, returns the operand that is
// not NaN). The scaling to e4m3 stays in fp32, as the rule has it. Not yet run.
// The build cache keys this file alone: after fp8_gemm.cu changes, clear $MXGEMM_CACHE_DIR/kernels.
#include "fp8_gemm.cu"

namespace {

__global__ void __launch_bounds__(128) gated_pairs_kernel(const __nv_bfloat16* __restrict__ G, int ldg,
                                                          const __nv_bfloat16* __restrict__ U, int ldu, int M, int K,
                                                          uint4* __restrict__ Q, float* __restrict__ XS, int Mp,
                                                          int Kp) {
  const int row = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = blockIdx.y * 4 + lane / 8;
  const int col = group * BK + 16 * (lane % 8);
  __nv_bfloat162 p[8];
  if (row < M && col < K) {  // K % 16 == 0 and 16-byte aligned rows (checked by the launcher)
    const uint4* gp = reinterpret_cast<const uint4*>(G + (size_t)row * ldg + col);
    const uint4* up = reinterpret_cast<const uint4*>(U + (size_t)row * ldu + col);
    const uint4 graw[2] = {__ldg(gp), __ldg(gp + 1)}, uraw[2] = {__ldg(up), __ldg(up + 1)};
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(graw);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(uraw);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 g = __bfloat1622float2(g2[i]);
      const float a0 = __fdiv_rn(g.x, __fadd_rn(1.f, expf(-g.x))), a1 = __fdiv_rn(g.y, __fadd_rn(1.f, expf(-g.y)));
      p[i] = __hmul2(__floats2bfloat162_rn(a0, a1), u2[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = __floats2bfloat162_rn(0.f, 0.f);
  }
  __nv_bfloat162 m2 = __habs2(p[0]);
#pragma unroll
  for (int i = 1; i < 8; ++i) m2 = __hmax2(m2, __habs2(p[i]));
  float amax = fmaxf(__low2float(m2), __high2float(m2));
#pragma unroll
  for (int off = 4; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  amax = fmaxf(amax, 0x1p-64f);
  const float inv = __fdiv_rn(448.f, amax);
  uint32_t bits[4];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float2 v = __bfloat1622float2(p[i]);
    const float lo = fminf(fmaxf(__fmul_rn(v.x, inv), -448.f), 448.f);
    const float hi = fminf(fmaxf(__fmul_rn(v.y, inv), -448.f), 448.f);
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    if (i % 2 == 0) bits[i / 2] = pair;
    else bits[i / 2] |= (uint32_t)pair << 16;
  }
  Q[((size_t)row * Kp + col) / 16] = make_uint4(bits[0], bits[1], bits[2], bits[3]);
  if (lane % 8 == 0) XS[(size_t)group * Mp + row] = __fdiv_rn(amax, 448.f);
}

}  // namespace

// silu(g) * u quantized per 1x128 as mxgemm_quant_gated_1x128 writes it: g, u bf16 [M, K] (16-byte aligned rows),
// xq [Mp, Kp] e4m3, xs [Kp/128, Mp]; Mp % 4 == 0, Kp % 512 == 0, K % 16 == 0. Returns a cudaError_t.
extern "C" int quant_lab_gated(const void* G, int ldg, const void* U, int ldu, int M, int K, void* XQ, void* XS,
                               int Mp, int Kp, void* stream) {
  const bool aligned = reinterpret_cast<uintptr_t>(G) % 16 == 0 && reinterpret_cast<uintptr_t>(U) % 16 == 0 &&
                       ldg % 8 == 0 && ldu % 8 == 0;
  if (!aligned || M > Mp || Mp % 4 || Kp % (4 * BK) || K % 16 || K > Kp) return (int)cudaErrorInvalidValue;
  gated_pairs_kernel<<<dim3(Mp / 4, Kp / (4 * BK)), 128, 0, (cudaStream_t)stream>>>(
      (const __nv_bfloat16*)G, ldg, (const __nv_bfloat16*)U, ldu, M, K, (uint4*)XQ, (float*)XS, Mp, Kp);
  return (int)cudaGetLastError();
}
