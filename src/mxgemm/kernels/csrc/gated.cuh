// The product a gated MLP feeds its down projection, silu(g) * u, one element as PyTorch computes it in T (bf16,
// fp16): SiLU as g / (1 + exp(-g)) in fp32 (an IEEE division and expf), rounded to T, times u in fp32, rounded to T
// (the bits of torch.nn.functional.silu(g) * u). Returned in fp32, which holds it exactly.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

template <typename T>
__device__ __forceinline__ float gated_value(float g, float u) {
  const float act = static_cast<float>(static_cast<T>(__fdiv_rn(g, __fadd_rn(1.f, expf(-g)))));
  return static_cast<float>(static_cast<T>(__fmul_rn(act, u)));
}
