"""Triton kernel: ``y = x @ dequant(W)^T (+ bias)`` reading MXFP8 weights (fp8 bytes + E8M0 scales) directly.

Exact ``w8a16``: each weight element is decoded to its exact value ``q * 2^(s-127)`` (representable in bf16 and in
tf32), multiplied on tensor cores with fp32 accumulation. bf16 activations use a bf16 dot; fp16 activations use a
tf32 dot, which holds every fp16 value exactly (bf16 would round them).

Decoding works on bits, so no fp8 hardware support is needed: an E4M3 byte ``seeeemmm`` placed as the fp16 bits
``s0eeeemmm0000000`` is the same number times 2^-8 (subnormals included, both formats share the mantissa layout);
an E5M2 byte is the high byte of the fp16 with its exact value. NaN elements are handled at preparation time (their
32-block's scale is set to NaN, which leaves every output unchanged: a NaN weight makes its whole output column NaN).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["w8a16_linear"]

_TWO_POW_M127 = 5.877471754111438e-39  # 2^-127, an fp32 subnormal


@triton.jit
def _decode_tile(w, s, BN: tl.constexpr, BK: tl.constexpr, E5M2: tl.constexpr):
    """uint8 weight tile [BN, BK] and uint8 scales [BN, BK // 32] -> exact fp32 values [BN, BK]."""
    w16 = w.to(tl.int16)
    if E5M2:
        wf = (w16 << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        bits = ((w16 & 0x80) << 8) | ((w16 & 0x7F) << 7)
        wf = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    s32 = s.to(tl.int32)
    sf = (s32 << 23).to(tl.float32, bitcast=True)
    sf = tl.where(s32 == 0, _TWO_POW_M127, sf)
    sf = tl.where(s32 == 255, float("nan"), sf)
    wf = tl.reshape(wf, (BN, BK // 32, 32)) * sf[:, :, None]
    return tl.reshape(wf, (BN, BK))


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_sn, stride_ym,
    HAS_BIAS: tl.constexpr, E5M2: tl.constexpr, X_FP16: tl.constexpr, DOT_FP32: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    # grouped ordering: programs that run together share weight tiles in L2
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % group_size
    pid_n = (pid % (GROUP_M * grid_n)) // group_size

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rks = tl.arange(0, BK // 32)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + rk) < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        s = tl.load(s_ptr + rn[:, None] * stride_sn + (k0 // 32 + rks)[None, :],
                    mask=n_ok[:, None] & ((k0 + rks * 32) < K)[None, :], other=127)  # fmt: skip
        wf = _decode_tile(w, s, BN, BK, E5M2)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(wf), input_precision="ieee")
        elif X_FP16:
            acc += tl.dot(x.to(tl.float32), tl.trans(wf), input_precision="tf32")
        else:
            acc += tl.dot(x, tl.trans(wf.to(tl.bfloat16)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_config(m: int, n: int, k: int) -> dict[str, int]:
    """A config that is always valid; tuned configs come from the autotuner."""
    if m <= 16:
        return dict(BM=16, BN=64, BK=128, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BM=64, BN=64, BK=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=3)


def w8a16_linear(
    x: torch.Tensor,
    w_bytes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    e5m2: bool = False,
    config: dict[str, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [M, K] bf16/fp16, ``w_bytes`` uint8 [N, K], ``scale`` uint8 [N, K/32] -> [M, N] in ``x.dtype``.

    ``out``: an [M, N] tensor of ``x.dtype`` with unit column stride to write into (else a new one).
    """
    m, k = x.shape
    n = w_bytes.shape[0]
    cfg = dict(config or default_config(m, n, k))
    if _interpreting():  # the Triton 3.6 interpreter computes bf16 dots wrongly; fp32 gives the same exact products
        cfg.pop("num_stages", None)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if y.shape != (m, n) or y.dtype != x.dtype or y.stride(1) != 1:
        raise ValueError(f"out must be a {x.dtype} [{m}, {n}] tensor with unit column stride")
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    _w8a16_kernel[grid](
        x, w_bytes, scale, bias if bias is not None else y, y,
        m, n, k,
        x.stride(0), x.stride(1), w_bytes.stride(0), scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, E5M2=e5m2, X_FP16=x.dtype == torch.float16, DOT_FP32=_interpreting(),
        **cfg,
    )  # fmt: skip
    return y
