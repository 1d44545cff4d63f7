"""Triton kernel: the 1x128 quantization of a routed block's rows for :mod:`mxgemm.kernels.grouped.wgmma`, in the
order the grouped GEMM reads them, bit-exact to :func:`mxgemm.block128.quantize_1x128`.

- gathered: row ``i`` is token ``src[i] // topk`` of ``x`` (the gate/up projection's input, sorted by expert);
- gated: row ``i`` is ``silu(gate) * up`` of row ``i`` of ``x = [gate | up]`` as PyTorch computes it in ``x``'s dtype
  (the down projection's input).

Layout: E4M3 bytes ``[Sp, Kp]`` and fp32 scales ``[Kp / 128, Sp]`` (``Sp`` the rows rounded up to 4, ``Kp`` K to
128; padded rows and columns quantize zeros).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import _interpreting, _silu_times, quantized_1x128, rounded

__all__ = ["quantize_rows"]

_BLOCK_ROWS = 16


@triton.jit
def _rows_kernel(
    x_ptr,
    src_ptr,
    q_ptr,
    s_ptr,
    S,
    K,
    Sp,
    Kp,
    TOPK,
    stride_x,
    BLOCK: tl.constexpr,
    GATHER: tl.constexpr,
    GATED: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rk = tl.program_id(1) * 128 + tl.arange(0, 128)
    ok = rm < S
    row = rm.to(tl.int64)
    if GATHER:
        row = (tl.load(src_ptr + rm, mask=ok, other=0) // TOPK).to(tl.int64)
    mask = ok[:, None] & (rk < K)[None, :]
    ptrs = x_ptr + row[:, None] * stride_x + rk[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if GATED:  # x holds gate, K columns further up
        out_ty = x_ptr.dtype.element_ty
        up = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        x = rounded(_silu_times(x, up, out_ty, INTERPRET), out_ty, INTERPRET)
    q, scale = quantized_1x128(x, INTERPRET)
    if INTERPRET:  # E4M3 values held in fp32: their own fp8 cast is exact
        q = q.to(tl.float8e4nv)
    keep = rm < Sp
    tl.store(q_ptr + rm.to(tl.int64)[:, None] * Kp + rk[None, :], q.to(tl.uint8, bitcast=True), mask=keep[:, None])
    tl.store(s_ptr + tl.program_id(1) * Sp + rm, scale, mask=keep)


def quantize_rows(
    x: torch.Tensor,
    src: torch.Tensor | None = None,
    topk: int = 1,
    *,
    gated: bool = False,
    block_rows: int = _BLOCK_ROWS,
    warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, K] bf16/fp16 (unit stride along K) -> (uint8 E4M3 ``[Sp, Kp]``, fp32 ``[Kp / 128, Sp]``) of the rows
    ``x[src // topk]`` (``src`` int32 [S]), of ``x``'s rows, or (``gated``: ``x`` [S, 2K] as ``[gate | up]``) of
    ``silu(gate) * up``; ``block_rows`` rows (a power of two) and ``warps`` warps a program, the same bits at any."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows = src.shape[0] if src is not None else x.shape[0]
    k = x.shape[1] // 2 if gated else x.shape[1]
    sp, kp = -(-rows // 4) * 4, -(-k // 128) * 128
    q = torch.empty((sp, kp), dtype=torch.uint8, device=x.device)
    s = torch.empty((kp // 128, sp), dtype=torch.float32, device=x.device)
    if sp and kp:
        _rows_kernel[(triton.cdiv(sp, block_rows), kp // 128)](
            x,
            x if src is None else src,  # not read without src
            q,
            s,
            rows,
            k,
            sp,
            kp,
            topk,
            x.stride(0),
            BLOCK=block_rows,
            GATHER=src is not None,
            GATED=gated,
            INTERPRET=_interpreting(),
            num_warps=warps,
        )
    return q, s
