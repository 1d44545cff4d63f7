"""Triton kernel: the grouped ``w8a8-block`` GEMM of a mixture of experts at decode, as a GEMV on CUDA cores.

The same products as :mod:`mxgemm.kernels.grouped.fp8` (rows sorted by expert, ``offsets`` int32 ``[E]``; ``W_e`` FP8
E4M3 ``[N, K]`` with one fp32 power-of-two scale per 128x128 block; each row quantized per 1x128 in the program,
bit-exact), in another shape: one program per (sorted row, ``bn`` weight rows), streaming ``kb`` 128-deep blocks of
its weight rows a step (their loads issued together), each converted to fp32 and multiplied by the row's quantized
block, summed in fp32 and added times the two scales. No tensor core, no shared-memory ring: many programs fit an SM,
as a kernel that only streams the active experts' bytes does, where the grouped kernel's 16-token tiles run one CTA an
SM at decode (docs/performance.md). Its sums are fp32 (within the fp32 sums' rounding of the exact product, closer
than the FP8 tensor cores' 14-bit block sums), so its outputs may differ from the grouped kernel's in the last bit: a
tactic of the same recipe, as two split-K tactics of a dense weight are. Each row reads its expert's weight rows once:
it is meant for experts of one row or two (one or a few tokens). The grid holds one program a row and weight-row tile
(1-row tiles are never partial); rows past ``offsets[-1]`` are written as zeros. The routed block's forms (gathered
gate/up with ``silu(gate) * up``, scattered down) as in :mod:`~mxgemm.kernels.grouped.fp8`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fp8 import _silu_times, quantized_1x128, rounded, routed_flags, tile_of

__all__ = ["GemvConfig", "grouped_gemv"]


@dataclass(frozen=True)
class GemvConfig:
    """A launch of the GEMV: ``bn`` weight rows a program, ``kb`` 128-deep blocks a step, ``warps`` (Triton's
    ``num_warps``) and ``stages`` (the steps whose loads Triton's pipeliner keeps in flight; 1: none). The routed
    block's gate/up takes ``bn / 2`` gate and ``bn / 2`` up rows a program."""

    bn: int = 32
    kb: int = 2
    warps: int = 4
    stages: int = 1

    def valid(self) -> bool:
        """``bn`` a power of two of 16-128, ``kb`` one of 1-16 with ``bn * kb`` at most 256, 2-8 warps, 1-4
        stages."""
        shape = self.bn in (16, 32, 64, 128) and self.kb in (1, 2, 4, 8, 16) and self.bn * self.kb <= 256
        return shape and self.warps in (2, 4, 8) and self.stages in range(1, 5)

    def launch(self, x, w_bytes, block_scale, offsets, n, **form) -> torch.Tensor:
        """:func:`grouped_gemv` with this config: how the grouped kernel's launches
        (:mod:`mxgemm.kernels.grouped.fp8`) run a tactic of the GEMV."""
        return grouped_gemv(x, w_bytes, block_scale, offsets, n, self, **form)


@triton.jit
def _w_times_x(w, xq):
    """[BN, KB, 128] E4M3 bytes times the quantized row [KB, 128] (fp32), summed over each 128: [BN, KB] in fp32."""
    w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.sum(w * xq[None, :, :], axis=2)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    off_ptr,
    y_ptr,
    src_ptr,
    S,
    N,
    K,
    E,
    TOPK,
    stride_xs,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ys,
    GROUPS: tl.constexpr,
    BN: tl.constexpr,
    KB: tl.constexpr,
    STAGES: tl.constexpr,
    GATHER: tl.constexpr,
    GATED: tl.constexpr,
    SCATTER: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    grp, row, _ = tile_of(tl.program_id(0), off_ptr, S, E, GROUPS, 1)
    if grp <= E:
        xm = row.to(tl.int64)
        ym = xm
        if GATHER or SCATTER:  # the row's token copy: x's row src // TOPK, or y's row src
            src = tl.load(src_ptr + xm).to(tl.int64)
            if GATHER:
                xm = src // TOPK
            if SCATTER:
                ym = src
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        n_ok = rn < N
        acc = tl.zeros((BN,), dtype=tl.float32)
        acc_up = tl.zeros((BN,), dtype=tl.float32)
        if grp < E:
            kb = tl.arange(0, KB)
            w_base = w_ptr + grp.to(tl.int64) * stride_we + rn[:, None, None] * stride_wn
            s_base = s_ptr + grp.to(tl.int64) * stride_se + (rn // 128)[:, None] * stride_sn
            s_up = s_ptr + grp.to(tl.int64) * stride_se + ((rn + N) // 128)[:, None] * stride_sn
            for k0 in tl.range(0, K, 128 * KB, num_stages=STAGES):
                kk = k0 + kb[:, None] * 128 + tl.arange(0, 128)[None, :]  # [KB, 128]
                k_ok = kk < K
                w_ptrs = w_base + kk[None, :, :]
                w_ok = n_ok[:, None, None] & k_ok[None, :, :]
                # the step's weight loads first, issued together before any is converted (loaded where converted,
                # ptxas issues each after the last one's conversion: one 16-byte load in flight a thread)
                w = tl.load(w_ptrs, mask=w_ok, other=0)
                if GATED:
                    w_up = tl.load(w_ptrs + N * stride_wn, mask=w_ok, other=0)
                x = tl.load(x_ptr + xm * stride_xs + kk, mask=k_ok, other=0.0).to(tl.float32)
                xq, x_scale = quantized_1x128(x, INTERPRET)
                xq = xq.to(tl.float32)
                blocks = k0 // 128 + kb
                b_ok = n_ok[:, None] & (blocks * 128 < K)[None, :]
                w_scale = tl.load(s_base + blocks[None, :], mask=b_ok, other=0.0)
                acc += tl.sum(_w_times_x(w, xq) * w_scale * x_scale[None, :], axis=1)
                if GATED:  # the up rows, N below the gate rows
                    up_scale = tl.load(s_up + blocks[None, :], mask=b_ok, other=0.0)
                    part = _w_times_x(w_up, xq)
                    acc_up += tl.sum(part * up_scale * x_scale[None, :], axis=1)
        out_ty = y_ptr.dtype.element_ty
        if GATED:
            acc = _silu_times(rounded(acc, out_ty, INTERPRET), rounded(acc_up, out_ty, INTERPRET), out_ty, INTERPRET)
        tl.store(y_ptr + ym * stride_ys + rn, rounded(acc, out_ty, INTERPRET).to(out_ty), mask=n_ok)


def grouped_gemv(
    x: torch.Tensor,
    w_bytes: torch.Tensor,
    block_scale: torch.Tensor,
    offsets: torch.Tensor,
    n: int,
    config: GemvConfig,
    *,
    rows: int,
    src: torch.Tensor | None = None,
    topk: int = 1,
    gated: bool = False,
    scatter: bool = False,
) -> torch.Tensor:
    """One grid over ``rows`` rows sorted by expert (``x`` has ``rows / topk`` rows where ``src`` gathers them) ->
    [rows, n] in ``x.dtype``; the arguments as :mod:`mxgemm.kernels.grouped.fp8`'s launches check them."""
    e = w_bytes.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    _gemv_kernel[(rows, triton.cdiv(n, config.bn))](  # 1-row tiles: as many as rows, none partial
        x,
        w_bytes,
        block_scale,
        offsets,
        y,
        offsets if src is None else src,  # not read without src
        rows,
        n,
        x.shape[1],
        e,
        topk,
        x.stride(0),
        w_bytes.stride(0),
        w_bytes.stride(1),
        block_scale.stride(0),
        block_scale.stride(1),
        y.stride(0),
        BN=config.bn,
        KB=config.kb,
        STAGES=config.stages,
        **routed_flags(e, src, gated, scatter),
        num_warps=config.warps,
    )
    return y
