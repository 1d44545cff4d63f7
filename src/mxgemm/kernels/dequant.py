"""The exact ``w8a16`` product at large M: the MX weight dequantized to bf16 by a Triton kernel, chunk by chunk into a
transient buffer, each chunk multiplied by cuBLAS (bf16 inputs, fp32 accumulation) straight into its output columns.

Every MX element times its power-of-two scale has at most 3 significant bits, so it is exactly a bf16 (except
below bf16's smallest subnormal, 2^-133: subnormal elements under scales of 2^-125 and less, which round as they do
in the ``w8a16`` kernel's bf16 dot): the products are the exact recipe's, the same values the kernel multiplies.
Nothing is stored beyond the call; the buffer holds at most ``max_chunk_bytes``. At large M the product is
compute-bound, so cuBLAS's bf16 rate plus one pass over the weight (read 1 byte, write 2 per element) beats decoding
every weight tile in the GEMM's inner loop once per row block of M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .w8a16 import _fp8_to, _interpreting, _scale_f32

__all__ = ["CHUNK_BYTES", "dequant_linear", "dequantize_bf16"]

CHUNK_BYTES = 256 * 2**20  # the transient bf16 buffer of one chunk of weight rows


@triton.jit
def _dequant_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    N,
    K,
    stride_q,
    stride_s,
    stride_o,
    E5M2: tl.constexpr,
    PLAIN_SCALES: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.program_id(1) * BK + tl.arange(0, BK)
    rs = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    w = tl.load(q_ptr + rn[:, None] * stride_q + rk[None, :], mask=mask, other=0)
    s = tl.load(
        s_ptr + rn[:, None] * stride_s + rs[None, :], mask=(rn[:, None] < N) & (rs[None, :] < K // 32), other=127
    )
    v = tl.reshape(_fp8_to(w, tl.float32, E5M2), (BN, BK // 32, 32)) * _scale_f32(s, PLAIN_SCALES)[:, :, None]
    tl.store(out_ptr + rn[:, None] * stride_o + rk[None, :], tl.reshape(v, (BN, BK)).to(tl.bfloat16), mask=mask)


def dequantize_bf16(
    w_bytes: torch.Tensor, scale: torch.Tensor, *, e5m2: bool = False, plain_scales: bool = False, out=None
) -> torch.Tensor:
    """uint8 ``[N, K]`` MX elements and uint8 E8M0 scales ``[N, K/32]`` -> their exact values as bf16 ``[N, K]``."""
    n, k = w_bytes.shape
    out = torch.empty((n, k), dtype=torch.bfloat16, device=w_bytes.device) if out is None else out
    bn, bk = (32, 256) if not _interpreting() else (16, 64)
    grid = (triton.cdiv(n, bn), triton.cdiv(k, bk))
    _dequant_kernel[grid](
        w_bytes,
        scale,
        out,
        n,
        k,
        w_bytes.stride(0),
        scale.stride(0),
        out.stride(0),
        E5M2=e5m2,
        PLAIN_SCALES=plain_scales,
        BN=bn,
        BK=bk,
    )
    return out


def dequant_linear(
    x: torch.Tensor,
    w_bytes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    e5m2: bool = False,
    plain_scales: bool = False,
    max_chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """``x`` bf16 ``[M, K]`` @ the dequantized weight^T (+ ``bias``) -> bf16 ``[M, N]``, the weight dequantized in
    chunks of rows of at most ``max_chunk_bytes`` (multiples of 128 rows)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the dequantize + cuBLAS path takes bf16 activations, got {x.dtype}")
    m, k = x.shape
    n = w_bytes.shape[0]
    rows = min(n, max(128, max_chunk_bytes // (2 * k) // 128 * 128))
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    buf = torch.empty((rows, k), dtype=torch.bfloat16, device=x.device)
    flags = torch.backends.cuda.matmul
    reduced = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = False  # fp32 accumulation throughout, as the recipe says
    try:
        for n0 in range(0, n, rows):
            n1 = min(n, n0 + rows)
            w = dequantize_bf16(w_bytes[n0:n1], scale[n0:n1], e5m2=e5m2, plain_scales=plain_scales, out=buf[: n1 - n0])
            if bias is None:
                torch.mm(x, w.t(), out=y[:, n0:n1])
            else:
                torch.addmm(bias[n0:n1].to(x.dtype), x, w.t(), out=y[:, n0:n1])
    finally:
        flags.allow_bf16_reduced_precision_reduction = reduced
    return y
