"""Triton kernel: activations to FP8 E4M3 with one fp32 scale per 1x128, laid out as cuBLASLt's blockwise GEMM wants.

Bit-exact to :func:`mxgemm.block128.quantize_1x128`: ``amax`` floored at 2^-64, ``scale = amax / 448`` and
``q = clamp(x * (448 / amax))`` with IEEE round-to-nearest divisions (``div_rn``), round-to-nearest-even to E4M3.

Output layout: ``q`` is ``[Mp, Kp]`` with ``Mp = round_up(M, 4)`` and ``Kp = round_up(K, 512)`` (padding is zero);
scales are stored K-block-major (``[Kp / 128, Mp]`` row-major) and returned as the ``[Mp, Kp / 128]`` view with
strides ``(1, Mp)`` that cuBLASLt takes for 1x128 scaling.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..block128 import padded_1x128_shape

__all__ = ["quantize_1x128_padded"]

_AMAX_FLOOR = tl.constexpr(2.0**-64)


@triton.jit
def _to_e4m3_bits(v):
    """fp32 -> E4M3 bytes with one round-to-nearest-even (Triton's own cast may round twice, through fp16)."""
    return tl.inline_asm_elementwise(
        asm="cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;",
        constraints="=h,r,r",
        args=[v],
        dtype=tl.uint8,
        is_pure=True,
        pack=2,
    )


@triton.jit
def _quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, Mp, Kp, stride_xm, stride_xk, BLOCK_M: tl.constexpr, INTERPRET: tl.constexpr
):
    if not INTERPRET:  # a kernel launched as this one's programmatic dependent (the FP8 GEMM) may start now
        tl.extra.cuda.gdc_launch_dependents()
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = g * 128 + tl.arange(0, 128)
    x = tl.load(
        x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=(rm < M)[:, None] & (rk < K)[None, :], other=0.0
    ).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR)
    inv = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    v = tl.clamp(x * inv[:, None], -448.0, 448.0)
    if INTERPRET:  # no inline PTX in the interpreter (whose fp8 rounding is itself wrong: see the tests)
        q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        q = _to_e4m3_bits(v)
    row_ok = rm < Mp
    tl.store(q_ptr + rm[:, None] * Kp + rk[None, :], q, mask=row_ok[:, None])
    tl.store(s_ptr + g * Mp + rm, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), mask=row_ok)


def quantize_1x128_padded(x: torch.Tensor, rows_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] bf16/fp16 -> (float8_e4m3fn [Mp, Kp], fp32 scale view [Mp, Kp/128] with strides (1, Mp)); the
    rows past M are zeros, Mp a multiple of cuBLASLt's row alignment and of ``rows_multiple``."""
    m, k = x.shape
    mp, kp = padded_1x128_shape(m, k, rows_multiple)
    q = torch.empty((mp, kp), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((kp // 128, mp), dtype=torch.float32, device=x.device)
    block_m = 16
    grid = (triton.cdiv(mp, block_m), kp // 128)
    _quant_kernel[grid](
        x,
        q.view(torch.uint8),
        s,
        m,
        k,
        mp,
        kp,
        x.stride(0),
        x.stride(1),
        BLOCK_M=block_m,
        INTERPRET=os.environ.get("TRITON_INTERPRET", "0") == "1",
        num_warps=4,
    )
    return q, s.t()
