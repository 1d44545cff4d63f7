"""Triton ``tl.dot_scaled`` GEMM, bf16 activations x MXFP8 weight: the portable MX path, as a benchmark baseline.

Not a backend: on SM90 Triton lowers ``dot_scaled`` to bf16 MMAs after upcasting, and some configs fault there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["DOT_SCALED_CONFIGS", "dot_scaled_linear"]

# The space a Triton autotuner would sweep for this GEMM: tiles, warps, stages.
DOT_SCALED_CONFIGS = [
    dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4),
    dict(BM=16, BN=128, BK=128, num_warps=4, num_stages=3),
    dict(BM=64, BN=128, BK=128, num_warps=4, num_stages=3),
    dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3),
    dict(BM=128, BN=128, BK=128, num_warps=8, num_stages=3),
    dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3),
]


@triton.jit
def _dot_scaled_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size
    pid_n = (pid % (GROUP_M * grid_n)) // size
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rks = tl.arange(0, BK // 32)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + rk) < K
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=(rm < M)[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + rn[None, :] * stride_wn + (k0 + rk)[:, None], mask=(rn < N)[None, :] & k_ok[:, None], other=0.0
        )
        s = tl.load(
            s_ptr + rn[:, None] * stride_sn + (k0 // 32 + rks)[None, :],
            mask=(rn < N)[:, None] & ((k0 + rks * 32) < K)[None, :],
            other=127,
        )
        acc = tl.dot_scaled(x, None, "bf16", w, s, "e4m3", acc)
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm < M)[:, None] & (rn < N)[None, :],
    )


def dot_scaled_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, config: dict) -> torch.Tensor:
    """``x`` [M, K] bf16 @ dequant(``qdata`` float8_e4m3fn [N, K], ``scale`` uint8 [N, K/32])^T -> bf16 [M, N]."""
    m, k = x.shape
    n = qdata.shape[0]
    cfg = dict(config)
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    _dot_scaled_kernel[grid](
        x, qdata, scale, y, m, n, k, x.stride(0), qdata.stride(0), scale.stride(0), y.stride(0), GROUP_M=8, **cfg
    )
    return y
