"""Triton kernel: activations to MXFP8 (1x32 blocks, E8M0 scales), bit-exact to :func:`mxgemm.quantize`.

Both scale rules (``floor``, ``rceil``), E4M3 and E5M2 elements. Scales are written straight into the layout the
GEMM consumes: row-major ``[M, K/32]``, or flattened 128x4 (cuBLAS / CUTLASS / FlashInfer) or 8x4 (TRT-LLM) atoms as
documented in :mod:`mxgemm.layouts` (padding bytes are zero).

The scale is computed from the bits of the block's fp32 amax, as in :mod:`mxgemm.format`; elements are ``x``
times the exact power of two ``2^-e``, clamped, then rounded to FP8 by integer arithmetic on the fp32 bits
(round-to-nearest-even, subnormals included). No fp8 conversion instruction is used, so the kernel gives the same
bits under Triton's CPU interpreter, whose fp8 casts round wrongly, as on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format import BLOCK_SIZE, ELEM_DTYPES
from ..layouts import padded_size_8x4, padded_size_128x4, round_up

__all__ = ["LAYOUTS", "mx_quantize"]

LAYOUTS = {"rowmajor": 0, "128x4": 1, "8x4": 2}


@triton.jit
def _round_to_fp8_bits(v, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr, NAN_BITS: tl.constexpr):
    """fp32 ``v`` (finite values already within the format's range, or NaN) -> FP8 bits as int32 (0..255)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    exp = (a >> 23) - 127
    sig = (a & 0x7FFFFF) | 0x800000  # 1.mantissa x 2^23
    # normal: keep MBITS mantissa bits; subnormal: count quanta of 2^(EMIN - MBITS)
    shift = tl.where(exp >= EMIN, 23 - MBITS, 23 - exp + EMIN - MBITS)
    shift = tl.minimum(shift, 25)  # anything shifted further is below half the smallest subnormal
    kept = sig >> shift
    rem = sig - (kept << shift)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((kept & 1) == 1))
    kept = kept + up.to(tl.int32)
    normal = ((exp + BIAS) << MBITS) + (kept - (1 << MBITS))  # a carry out of the mantissa bumps the exponent
    out = tl.where(exp >= EMIN, normal, kept)  # subnormal: a carry to 2^MBITS is the smallest normal, as bits
    out = tl.where(a == 0, 0, out)
    out = tl.where(a > 0x7F800000, NAN_BITS, out)
    return out | sign


@triton.jit
def _mx_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    stride_xm,
    cols_padded,
    RCEIL: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
    BIAS: tl.constexpr,
    EMAX: tl.constexpr,
    MAX_ELEM: tl.constexpr,
    TOP_FRACTION: tl.constexpr,
    NAN_BITS: tl.constexpr,
    LAYOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)  # one 32-block column per program
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = kb * 32 + tl.arange(0, 32)
    row_ok = rm < M
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    abits = amax.to(tl.int32, bitcast=True)
    if RCEIL:
        d = tl.math.div_rn(amax, tl.full(amax.shape, MAX_ELEM, tl.float32)).to(tl.int32, bitcast=True)
        dexp = (d >> 23) & 0xFF
        dman = d & 0x7FFFFF
        biased = tl.where(dexp == 0, (dman > 0x400000).to(tl.int32), dexp + (dman != 0).to(tl.int32))
        biased = tl.minimum(biased, 254)
    else:
        biased = tl.minimum(tl.maximum(((abits >> 23) & 0xFF) - 127 - EMAX, -127), 127) + 127
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0  # tl.max drops NaNs, so look for them
    finite = (abits < 0x7F800000) & ~has_nan  # amax >= 0: inf has bits 0x7F800000
    biased = tl.where(finite, biased, 255)
    # 2^-(biased-127), exactly: biased 254 -> 2^-127 is an fp32 subnormal (bits 0x400000)
    inv_bits = tl.where(biased == 254, 0x400000, (254 - biased) << 23)
    inv = inv_bits.to(tl.float32, bitcast=True)
    v = x * inv[:, None]
    # the element just below 2^(255 - biased): scales from 2^120 up would let the largest elements overflow fp32 on
    # dequantization (``mxgemm.format.element_limit``); 2^p is inf in fp32 for p >= 128
    top_bits = tl.where(biased >= 128, (382 - biased) << 23, 0x7F800000)
    limit = tl.minimum(top_bits.to(tl.float32, bitcast=True) * TOP_FRACTION, MAX_ELEM)
    v = tl.where(finite[:, None], tl.minimum(tl.maximum(v, -limit[:, None]), limit[:, None]), float("nan"))
    q = _round_to_fp8_bits(v, MBITS, EMIN, BIAS, NAN_BITS)
    tl.store(q_ptr + rm[:, None] * K + rk[None, :], q.to(tl.uint8), mask=row_ok[:, None])
    if LAYOUT == 0:
        offset = rm * (K // 32) + kb
    elif LAYOUT == 1:
        offset = ((rm // 128) * (cols_padded // 4) + kb // 4) * 512 + (rm % 32) * 16 + ((rm % 128) // 32) * 4 + kb % 4
    else:
        offset = ((rm // 8) * (cols_padded // 4) + kb // 4) * 32 + (rm % 8) * 4 + kb % 4
    tl.store(s_ptr + offset, biased.to(tl.uint8), mask=row_ok)


_FORMATS = {  # elem dtype -> (mantissa bits, min normal exponent, bias, NaN bits as torch writes them)
    torch.float8_e4m3fn: (3, -6, 7, 0x7F),
    torch.float8_e5m2: (2, -14, 15, 0x7F),
}


def mx_quantize(
    x: torch.Tensor,
    *,
    scale_mode: str = "floor",
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    layout: str = "rowmajor",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (bf16/fp16/fp32, K % 32 == 0) -> (fp8 [M, K], uint8 scales in ``layout``).

    ``layout``: ``rowmajor`` ([M, K/32]), ``128x4`` or ``8x4`` (flat, padded with zeros).
    """
    if x.dim() != 2 or x.shape[1] % BLOCK_SIZE:
        raise ValueError(f"expected [M, K] with K a multiple of {BLOCK_SIZE}, got shape {tuple(x.shape)}")
    if layout not in LAYOUTS or scale_mode not in ("floor", "rceil") or elem_dtype not in _FORMATS:
        raise ValueError(f"unsupported layout {layout!r}, scale_mode {scale_mode!r} or elem_dtype {elem_dtype}")
    m, k = x.shape
    cols = k // BLOCK_SIZE
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    if layout == "rowmajor":
        s = torch.empty((m, cols), dtype=torch.uint8, device=x.device)
    else:
        size = padded_size_128x4(m, cols) if layout == "128x4" else padded_size_8x4(m, cols)
        s = torch.zeros(size, dtype=torch.uint8, device=x.device)
    max_elem, emax = ELEM_DTYPES[elem_dtype]
    mbits, emin, bias, nan_bits = _FORMATS[elem_dtype]
    block_m = 16
    x = x.contiguous() if x.stride(1) != 1 else x
    _mx_quant_kernel[(triton.cdiv(m, block_m), cols)](
        x,
        q,
        s,
        m,
        k,
        x.stride(0),
        round_up(cols, 4),
        RCEIL=scale_mode == "rceil",
        MBITS=mbits,
        EMIN=emin,
        BIAS=bias,
        EMAX=emax,
        MAX_ELEM=max_elem,
        TOP_FRACTION=1.0 - 2.0 ** -(mbits + 1),
        NAN_BITS=nan_bits,
        LAYOUT=LAYOUTS[layout],
        BLOCK_M=block_m,
    )
    return q.view(elem_dtype), s
