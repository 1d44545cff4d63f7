// The glue of a routed mixture-of-experts block around its two grouped GEMMs, with the bits of the Triton kernels
// of mxgemm.kernels.grouped (routing.py, quant.py), so that one C call runs the whole block:
// - sort_by_expert: the token copies (t * k + j) sorted by expert, stably, and each expert's cumulative row end; copies
//   routed outside [0, E) after the last expert's rows (count_kernel, then place_kernel);
// - gather_quant_kernel: row i of the gate/up input is token src[i] / k, quantized per 1x128 (quant_values' rule);
// - combine_kernel: each token's copies, weighted by the router and summed in fp32 in top-k order, one rounding.
// Deterministic, no host synchronisation, shapes from the token count alone.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "quant_1x128.cuh"

namespace moe {

constexpr int kSortThreads = 256;  // copies a sorting block takes at a time
constexpr int kSortPer = 1024;     // copies each sorting block owns
constexpr int kSortWarps = kSortThreads / 32;

// the sorting key of copy i: its expert, E for a copy routed outside [0, E), -1 past the copies
template <typename I>
__device__ __forceinline__ int sort_key(const I* __restrict__ ids, long long i, long long copies, int E) {
  if (i >= copies) return -1;
  const int e = static_cast<int>(ids[i]);  // as the Triton kernels read them: the low 32 bits
  return e >= 0 && e < E ? e : E;
}

// counts[p][0..E] (E + 1 a block, the last those routed outside): block p's copies [p * kSortPer, +kSortPer) by key
template <typename I>
__global__ void __launch_bounds__(kSortThreads) count_kernel(const I* __restrict__ ids, long long copies, int E,
                                                             int* __restrict__ counts) {
  extern __shared__ int cnt[];  // [E + 1]
  for (int e = threadIdx.x; e <= E; e += kSortThreads) cnt[e] = 0;
  __syncthreads();
  const long long lo = (long long)blockIdx.x * kSortPer;
  for (long long i = lo + threadIdx.x; i < lo + kSortPer; i += kSortThreads) {
    const int key = sort_key(ids, i, copies, E);
    if (key >= 0) atomicAdd(&cnt[key], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= E; e += kSortThreads) counts[(size_t)blockIdx.x * (E + 1) + e] = cnt[e];
}

// Block p's copies placed: src[row] = copy, rows of each key in copy order after those of the blocks before p; block 0
// writes offsets[e], each expert's cumulative row end. Shared memory: base and total [E + 1], warp_cnt[kSortWarps][E + 1].
template <typename I>
__global__ void __launch_bounds__(kSortThreads) place_kernel(const I* __restrict__ ids, long long copies, int E,
                                                             const int* __restrict__ counts, int blocks,
                                                             int* __restrict__ offsets, int* __restrict__ src) {
  extern __shared__ int smem[];
  int* base = smem;                    // the row of this block's next copy of each key
  int* total = smem + (E + 1);         // copies of each key in every block
  int* warp_cnt = smem + 2 * (E + 1);  // [warp][key] copies of the key in a warp's 32 of the current step
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int e = threadIdx.x; e <= E; e += kSortThreads) {
    int before = 0, all = 0;
    for (int q = 0; q < blocks; ++q) {
      const int c = counts[(size_t)q * (E + 1) + e];
      all += c;
      before += q < (int)blockIdx.x ? c : 0;
    }
    base[e] = before;  // copies of key e in the blocks before this one
    total[e] = all;
  }
  for (int j = threadIdx.x; j < kSortWarps * (E + 1); j += kSortThreads) warp_cnt[j] = 0;
  __syncthreads();
  if (warp == 0) {  // each key's first row: every copy of the keys before it (a warp's scan, 32 keys a step)
    int carry = 0;
    for (int e0 = 0; e0 <= E; e0 += 32) {
      const int e = e0 + lane;
      int run = e <= E ? total[e] : 0;
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int up = __shfl_up_sync(0xffffffffu, run, d);
        if (lane >= d) run += up;
      }
      if (e <= E) {
        base[e] += carry + run - total[e];
        if (blockIdx.x == 0 && e < E) offsets[e] = carry + run;
      }
      carry += __shfl_sync(0xffffffffu, run, 31);
    }
  }
  __syncthreads();
  const long long lo = (long long)blockIdx.x * kSortPer;
  for (long long step = lo; step < lo + kSortPer && step < copies; step += kSortThreads) {
    const long long i = step + threadIdx.x;
    const int key = i < lo + kSortPer ? sort_key(ids, i, copies, E) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, key);
    const int rank = __popc(same & ((1u << lane) - 1));  // copies of the key before this one in the warp
    if (key >= 0 && rank == 0) warp_cnt[warp * (E + 1) + key] = __popc(same);
    __syncthreads();
    if (key >= 0) {
      int row = base[key] + rank;
      for (int w = 0; w < warp; ++w) row += warp_cnt[w * (E + 1) + key];
      src[row] = (int)i;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += kSortThreads) {
      int step_total = 0;
      for (int w = 0; w < kSortWarps; ++w) {
        step_total += warp_cnt[w * (E + 1) + e];
        warp_cnt[w * (E + 1) + e] = 0;
      }
      base[e] += step_total;
    }
    __syncthreads();
  }
}

inline int sort_blocks(long long copies) { return (int)((copies + kSortPer - 1) / kSortPer); }

// offsets [E], src [copies]; counts: sort_blocks(copies) * (E + 1) ints of scratch
template <typename I>
cudaError_t sort_by_expert(const I* ids, long long copies, int E, int* counts, int* offsets, int* src,
                           cudaStream_t st) {
  const int blocks = sort_blocks(copies);
  const size_t count_smem = (size_t)(E + 1) * sizeof(int), place_smem = count_smem * (2 + kSortWarps);
  count_kernel<I><<<blocks, kSortThreads, count_smem, st>>>(ids, copies, E, counts);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (place_smem > 48 * 1024) {
    err = cudaFuncSetAttribute(place_kernel<I>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)place_smem);
    if (err != cudaSuccess) return err;
  }
  place_kernel<I><<<blocks, kSortThreads, place_smem, st>>>(ids, copies, E, counts, blocks, offsets, src);
  return cudaGetLastError();
}

// Rows [Mp, Kp] e4m3 and scales [Kp / 128, Mp] of row i = token src[i] / topk of X [M, K] (row stride ldx), for
// i < rows; zeros past them (quant_1x128_kernel's layout and rule), a warp per row, in the two shapes of the dense
// quantizers: N = 4 elements a lane, a 128-wide K group a warp (quant_1x128_kernel's); N = 16, four consecutive K
// groups a warp and 8 lanes a group (quant_1x128_wide_kernel's: two 16-byte loads where rows are 16-byte aligned, one
// 16-byte store, 3 shuffle steps a group instead of 5; Kp % 512 == 0), for grids of several waves
template <typename T, int N>
__global__ void __launch_bounds__(128) gather_quant_kernel(const T* __restrict__ X, int ldx, int M, int K,
                                                           const int* __restrict__ src, int topk, int rows,
                                                           uint8_t* __restrict__ Q, float* __restrict__ XS, int Mp,
                                                           int Kp) {
  constexpr int LANES = sm90::BK / N;  // lanes a group
  const int row = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = blockIdx.y * (32 / LANES) + lane / LANES;
  const int col = group * sm90::BK + N * (lane % LANES);
  const int token = row < rows ? src[row] / topk : M;  // M: a row of zeros
  float v[N];
  load_values<T, N>(X, ldx, token, col, M, K, v);
  uint32_t bits[N / 4];
  const float scale = quant_values<N, LANES>(v, bits);
  const size_t at = (size_t)row * Kp + col;
  if constexpr (N == 4)
    reinterpret_cast<uint32_t*>(Q)[at / 4] = bits[0];
  else
    reinterpret_cast<uint4*>(Q)[at / 16] = make_uint4(bits[0], bits[1], bits[2], bits[3]);
  if (lane % LANES == 0) XS[(size_t)group * Mp + row] = scale;
}

// out[t] = round(sum_j round(y[t * k + j] * w[t, j])) for j = 0..k-1 in turn, in fp32 (each product rounded to T
// first), 8 consecutive columns a thread where rows are 16-byte aligned
template <typename T>
__global__ void __launch_bounds__(256) combine_kernel(const T* __restrict__ Y, const T* __restrict__ W, T* __restrict__ out,
                                                      int H, int topk) {
  const long long t = blockIdx.x;
  const int h0 = (blockIdx.y * 256 + threadIdx.x) * 8;
  if (h0 >= H) return;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const bool vec = H % 8 == 0 && reinterpret_cast<uintptr_t>(Y) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int j = 0; j < topk; ++j) {
    const float w = static_cast<float>(W[t * topk + j]);
    const T* row = Y + (t * topk + j) * H;
    T y[8];
    if (vec) {
      *reinterpret_cast<uint4*>(y) = __ldg(reinterpret_cast<const uint4*>(row + h0));
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) y[i] = h0 + i < H ? row[h0 + i] : static_cast<T>(0.f);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i)
      acc[i] = __fadd_rn(acc[i], static_cast<float>(static_cast<T>(__fmul_rn(static_cast<float>(y[i]), w))));
  }
  T o[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) o[i] = static_cast<T>(acc[i]);
  if (vec) {
    *reinterpret_cast<uint4*>(out + t * H + h0) = *reinterpret_cast<const uint4*>(o);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (h0 + i < H) out[t * H + h0 + i] = o[i];
  }
}

}  // namespace moe
