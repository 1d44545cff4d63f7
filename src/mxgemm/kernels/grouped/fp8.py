"""Triton kernel: the grouped ``w8a8-block`` GEMM of a mixture of experts, rows sorted by expert.

``y[i] = q(x[i]) @ W_e^T`` for the expert ``e`` whose rows hold ``i`` (``offsets`` int32 ``[E]``, cumulative row
ends), with ``W_e`` FP8 E4M3 ``[N, K]`` and one fp32 power-of-two scale per 128x128 block, and ``q`` the 1x128
quantization of :func:`mxgemm.block128.quantize_1x128`, made in the kernel on the tile it multiplies (bit-exact:
``amax`` floored at 2^-64, IEEE divisions, one round-to-nearest-even to E4M3), so activations take no pass of their
own. Rows at or past ``offsets[-1]`` are written as zeros.

Work: one program per (token tile of one expert, ``BN`` weight rows). The grid is sized from the row count and E
alone (``cdiv(S, BM) + min(E + 1, S)`` token-tile slots bound the tiles of any routing), and each program finds its
expert and tile from ``offsets`` on the device, so nothing is read on the host and a CUDA graph replays any routing
of the same row count; slots past the routing's tiles return at once. Swap-AB: ``acc[BN, BM] = W_tile @ q(x)^T``,
so the weight is the MMA's wide side and a few tokens fill its narrow one. Each 128-deep step is multiplied in its
own FP8 MMA and added to an fp32 accumulator times its two scales.

``quantized`` configs read rows quantized apart instead (the 1x128 quantizer of :mod:`mxgemm.kernels.act_quant`;
the same bits): with many rows per expert, quantizing in the kernel would repeat the work for every weight-row tile.

Each launch takes a :class:`~mxgemm.kernels.grouped.gemv.GemvConfig` instead where a tactic gives one
(:class:`OtherKernel`): the same products as a GEMV on CUDA cores, one sorted row a program
(:mod:`mxgemm.kernels.grouped.gemv`).

The routed block's forms (:func:`grouped_gate_up`, :func:`grouped_down`) read ``src``, the token copy at each sorted
row (:func:`mxgemm.kernels.grouped.routing.sort_by_expert`): gate/up reads row ``src // k`` of the tokens in place
(gathers) and takes gate rows and the up rows ``N`` below them in each program, writing ``silu(gate) * up``; down
writes each row to row ``src`` of its output (scatters), so its output is in token order.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Protocol

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...block128 import quantize_1x128
from ..act_quant import _to_e4m3_bits, quantize_1x128_padded  # the 1x128 quantizer and its rounding

__all__ = [
    "GroupedConfig",
    "default_config",
    "grouped_block_linear",
    "grouped_down",
    "grouped_gate_up",
    "token_tile_slots",
]

_AMAX_FLOOR = tl.constexpr(2.0**-64)
_FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _nearest_e4m3(v):
    """fp32 in [-448, 448] -> the nearest E4M3 value (ties to even), as fp32: adding and taking away 1.5 * 2^23
    times E4M3's spacing at ``|v|`` rounds ``v`` to a multiple of that spacing. The interpreter's path: its own fp8
    cast rounds twice."""
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    spacing = tl.maximum(exponent, -6) - 3  # E4M3 keeps 3 mantissa bits; below 2^-6 it is subnormal
    magic = (((spacing + 127 + 23) << 23).to(tl.float32, bitcast=True)) * 1.5
    return (v + magic) - magic


@triton.jit
def _grouped_kernel(
    x_ptr,
    xs_ptr,
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
    stride_xsk,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ys,
    GROUPS: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
    QUANTIZED: tl.constexpr,
    GATHER: tl.constexpr,
    GATED: tl.constexpr,
    SCATTER: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    grp, first_row, end_row = tile_of(slot, off_ptr, S, E, GROUPS, BM)
    if grp <= E:
        rm = first_row + tl.arange(0, BM)
        m_ok = rm < end_row
        rm64 = rm.to(tl.int64)
        xm = rm64  # the rows of x and y this tile reads and writes
        ym = rm64
        if GATHER or SCATTER:  # the row's token copy: x's row src // TOPK, or y's row src
            src = tl.load(src_ptr + rm64, mask=m_ok, other=0).to(tl.int64)
            if GATHER:
                xm = src // TOPK
            if SCATTER:
                ym = src
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        acc_up = tl.zeros((BN, BM), dtype=tl.float32)
        if grp < E:
            rk = tl.arange(0, 128)
            w_base = w_ptr + grp.to(tl.int64) * stride_we + rn[:, None] * stride_wn
            s_base = s_ptr + grp.to(tl.int64) * stride_se + (rn // 128) * stride_sn
            s_up = s_ptr + grp.to(tl.int64) * stride_se + ((rn + N) // 128) * stride_sn
            for k0 in range(0, K, 128):
                k_ok = (k0 + rk) < K
                x_ptrs = x_ptr + xm[:, None] * stride_xs + (k0 + rk)[None, :]
                if QUANTIZED:  # FP8 rows and their 1x128 scales, quantized apart
                    xq = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0).to(tl.float8e4nv, bitcast=True)
                    x_scale = tl.load(xs_ptr + (k0 // 128) * stride_xsk + xm, mask=m_ok, other=0.0)
                    if INTERPRET:
                        xq = xq.to(tl.float32)
                else:
                    x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                    xq, x_scale = quantized_1x128(x, INTERPRET)
                w_ptrs = w_base + (k0 + rk)[None, :]
                part = _fp8_dot(tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0), xq, INTERPRET)
                w_scale = tl.load(s_base + k0 // 128, mask=n_ok, other=0.0)
                acc += part * w_scale[:, None] * x_scale[None, :]
                if GATED:  # the up rows, N below the gate rows
                    w_up = tl.load(w_ptrs + N * stride_wn, mask=n_ok[:, None] & k_ok[None, :], other=0)
                    up_scale = tl.load(s_up + k0 // 128, mask=n_ok, other=0.0)
                    acc_up += _fp8_dot(w_up, xq, INTERPRET) * up_scale[:, None] * x_scale[None, :]
        out_ty = y_ptr.dtype.element_ty
        if GATED:
            gate = rounded(acc, out_ty, INTERPRET)
            acc = _silu_times(gate, rounded(acc_up, out_ty, INTERPRET), out_ty, INTERPRET)
        y_ptrs = y_ptr + ym[None, :] * stride_ys + rn[:, None]
        tl.store(y_ptrs, rounded(acc, out_ty, INTERPRET).to(out_ty), mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def tile_of(slot, off_ptr, S, E, GROUPS: tl.constexpr, BM: tl.constexpr):
    """Token-tile ``slot``'s group (0..E-1 the experts, E the rows past the last expert's end, E + 1 a slot past
    every tile), the tile's first row and its group's end row, from ``offsets`` with each bound clamped to [0, S]."""
    g = tl.arange(0, GROUPS)
    end = tl.where(g < E, tl.load(off_ptr + g, mask=g < E, other=0), S)
    prev = tl.load(off_ptr + g - 1, mask=(g >= 1) & (g <= E), other=0)
    start = tl.where(g == 0, 0, tl.where(g <= E, prev, S))
    end = tl.minimum(tl.maximum(end, 0), S)
    start = tl.minimum(tl.maximum(start, 0), S)
    tiles = (tl.maximum(end - start, 0) + BM - 1) // BM
    last = tl.cumsum(tiles, axis=0)  # the slot after each group's last tile
    grp = tl.sum((last <= slot).to(tl.int32), axis=0)
    mine = g == grp
    first_slot = tl.sum(tl.where(mine, last - tiles, 0), axis=0)
    first_row = tl.sum(tl.where(mine, start, 0), axis=0) + (slot - first_slot) * BM
    return grp, first_row, tl.sum(tl.where(mine, end, 0), axis=0)


@triton.jit
def quantized_1x128(x, INTERPRET: tl.constexpr):
    """fp32 rows of one 128-wide group [R, 128] by the 1x128 rule (``amax`` floored at 2^-64, IEEE divisions, one
    round-to-nearest-even): (their E4M3 values, as float8e4nv; as fp32 under the interpreter, whose own cast rounds
    twice), and each row's scale ``amax / 448``."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR)
    full = tl.full(amax.shape, _FP8_MAX, tl.float32)
    v = tl.clamp(x * tl.math.div_rn(full, amax)[:, None], -_FP8_MAX, _FP8_MAX)
    if INTERPRET:
        q = _nearest_e4m3(v)
    else:
        q = _to_e4m3_bits(v).to(tl.float8e4nv, bitcast=True)
    return q, tl.math.div_rn(amax, full)


@triton.jit
def rounded(v, out_ty: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``v`` rounded to ``out_ty`` (to nearest, ties to even), held in fp32. The interpreter's own cast to bf16
    truncates; there the rounding is made on the bits."""
    if INTERPRET and out_ty == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return v.to(out_ty).to(tl.float32)


@triton.jit
def _fp8_dot(w, xq, INTERPRET: tl.constexpr):
    """``w`` (E4M3 bytes) times ``xq^T`` in fp32: FP8 tensor cores, or the interpreter's fp32 product of the same
    values."""
    if INTERPRET:
        wf = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return tl.dot(wf, tl.trans(xq), input_precision="ieee")
    return tl.dot(w.to(tl.float8e4nv, bitcast=True), tl.trans(xq))


@triton.jit
def _silu_times(gate, up, out_ty: tl.constexpr, INTERPRET: tl.constexpr):
    """``silu(gate) * up`` as PyTorch computes it in ``out_ty`` (gate and up already rounded to it, held in fp32):
    SiLU as ``gate / (1 + exp(-gate))`` in fp32 (an IEEE division and ``expf``), rounded to ``out_ty``, times ``up``
    in fp32; fp32, to be rounded to ``out_ty`` once more. ``expf`` is libdevice's, as CUDA's."""
    if INTERPRET:  # the interpreter's exp: NumPy's
        e = tl.exp(-gate)
    else:
        e = libdevice.exp(-gate)
    act = tl.math.div_rn(gate, 1.0 + e)
    return rounded(act, out_ty, INTERPRET) * up


@dataclass(frozen=True)
class GroupedConfig:
    """A launch of the kernel: ``bn`` weight rows x ``bm`` tokens of one expert per program, ``warps`` and ``stages``
    (Triton's ``num_warps``, ``num_stages``), and whether the rows are ``quantized`` apart first."""

    bn: int = 64
    bm: int = 16
    warps: int = 4
    stages: int = 3
    quantized: bool = False

    def valid(self) -> bool:
        """``bn`` and ``bm`` powers of two of 16-256, 4 or 8 warps, 1-5 stages."""
        tiles = (16, 32, 64, 128, 256)
        return self.bn in tiles and self.bm in tiles and self.warps in (4, 8) and self.stages in range(1, 6)


class OtherKernel(Protocol):
    """The config of another kernel of the same products (the GEMV's: :mod:`mxgemm.kernels.grouped.gemv`), which the
    launches below run through its ``launch`` with the arguments checked."""

    def valid(self) -> bool: ...

    def launch(self, x, w_bytes, block_scale, offsets, n, **form) -> torch.Tensor: ...


def default_config(rows: int, experts: int) -> GroupedConfig:
    """By the rows per expert of an even routing of ``rows`` over ``experts``: below 64, 128 weight rows x 16 tokens
    per program, quantized in the kernel; from 64, rows quantized apart and 64-token tiles, 128 weight rows of 4 warps
    (256 of 8 warps from 256 rows per expert). Of the configs timed on the H100 (lab/grouped_configs.py,
    Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 experts at 1-4096 tokens) the best on 11 of 15 problems and within
    7% on 3; Mixtral's gate/up at one token (two experts' 448 programs) takes 15% longer than 64 weight rows of 8
    warps would."""
    per = -(-rows // max(experts, 1))
    if per < 64:
        return GroupedConfig(128, 16, 4, 3)
    return GroupedConfig(256, 64, 8, 3, quantized=True) if per >= 256 else GroupedConfig(128, 64, 4, 3, quantized=True)


def token_tile_slots(rows: int, experts: int, bm: int) -> int:
    """Token-tile slots that hold the tiles of any routing of ``rows`` rows over ``experts`` experts and the rows
    past them: each of at most ``min(E + 1, rows)`` non-empty groups adds at most one partial tile."""
    return triton.cdiv(rows, bm) + min(experts + 1, rows)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def routed_flags(experts: int, src: torch.Tensor | None, gated: bool, scatter: bool) -> dict:
    """The compile-time flags a grouped launch passes its kernel: the E + 1 routing groups rounded up to a power of
    two, whether rows are gathered through ``src`` (not when they are scattered through it), gated, scattered, and
    whether Triton's interpreter runs it."""
    return {
        "GROUPS": triton.next_power_of_2(experts + 1),
        "GATHER": src is not None and not scatter,
        "GATED": gated,
        "SCATTER": scatter,
        "INTERPRET": _interpreting(),
    }


def grouped_block_linear(
    x: torch.Tensor,
    w_bytes: torch.Tensor,
    block_scale: torch.Tensor,
    offsets: torch.Tensor,
    n: int,
    config: GroupedConfig | OtherKernel | None = None,
) -> torch.Tensor:
    """``x`` [S, K] bf16/fp16 (unit stride along K), rows sorted by expert; ``w_bytes`` uint8 (E4M3 bits)
    ``[E, >= n, K]``; ``block_scale`` fp32 ``[E, >= ceil(n/128), >= ceil(K/128)]``; ``offsets`` int32 ``[E]`` on
    ``x``'s device -> [S, n] in ``x.dtype``."""
    return _launch(x, w_bytes, block_scale, offsets, n, config, rows=x.shape[0])


def grouped_gate_up(
    x: torch.Tensor,
    w_bytes: torch.Tensor,
    block_scale: torch.Tensor,
    offsets: torch.Tensor,
    src: torch.Tensor,
    topk: int,
    config: GroupedConfig | OtherKernel | None = None,
) -> torch.Tensor:
    """The gate/up projection of a routed block on its tokens in place: ``x`` [T, K] in token order, ``src`` int32
    [S] the token copy (``token * topk + j``) each row sorted by expert reads, ``w_bytes`` ``[E, 2I, K]`` (gate rows,
    then up) -> ``silu(gate) * up`` [S, I] in ``x.dtype``, rows sorted by expert, as PyTorch computes the product in
    that dtype. ``config`` as for ``2I`` outputs (each program takes half its ``bn`` of gate and of up rows)."""
    s = src.shape[0]
    c = config or default_config(s, w_bytes.shape[0])
    half = dataclasses.replace(c, bn=max(c.bn // 2, 16))
    return _launch(
        x, w_bytes, block_scale, offsets, w_bytes.shape[1] // 2, half, rows=s, src=src, topk=topk, gated=True
    )


def grouped_down(
    x: torch.Tensor,
    w_bytes: torch.Tensor,
    block_scale: torch.Tensor,
    offsets: torch.Tensor,
    src: torch.Tensor,
    n: int,
    config: GroupedConfig | OtherKernel | None = None,
) -> torch.Tensor:
    """:func:`grouped_block_linear` with each output row written to its token copy's place: row ``i`` of the result
    [S, n] is sorted row ``j`` with ``src[j] == i`` (``src`` a permutation of ``range(S)``)."""
    return _launch(x, w_bytes, block_scale, offsets, n, config, rows=x.shape[0], src=src, scatter=True)


def _launch(
    x: torch.Tensor,
    w_bytes: torch.Tensor,
    block_scale: torch.Tensor,
    offsets: torch.Tensor,
    n: int,
    config: GroupedConfig | OtherKernel | None,
    *,
    rows: int,
    src: torch.Tensor | None = None,
    topk: int = 1,
    gated: bool = False,
    scatter: bool = False,
) -> torch.Tensor:
    """One grid of :func:`_grouped_kernel` over ``rows`` rows sorted by expert (``x`` has ``rows / topk`` rows where
    ``src`` gathers them), or another kernel's launch where ``config`` is its (:class:`OtherKernel`)."""
    k = x.shape[1]
    e = w_bytes.shape[0]
    c = config or default_config(rows, e)
    if not c.valid():
        raise ValueError(f"the grouped kernel cannot run {c}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w_bytes.stride(2) != 1 or block_scale.dtype != torch.float32 or offsets.dtype != torch.int32:
        raise ValueError("the grouped kernel reads uint8 weights of unit stride along K, fp32 scales, int32 offsets")
    if not isinstance(c, GroupedConfig):
        form = {"rows": rows, "src": src, "topk": topk, "gated": gated, "scatter": scatter}
        return c.launch(x, w_bytes, block_scale, offsets, n, **form)
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    xs, stride_xsk = block_scale, 0  # not read unless quantized
    if c.quantized:
        x, xs = _quantized_rows(x)
        stride_xsk = xs.stride(1)
    grid = (token_tile_slots(rows, e, c.bm), triton.cdiv(n, c.bn))
    cfg = {"num_warps": c.warps} if _interpreting() else {"num_warps": c.warps, "num_stages": c.stages}
    _grouped_kernel[grid](
        x,
        xs,
        w_bytes,
        block_scale,
        offsets,
        y,
        offsets if src is None else src,  # not read without src
        rows,
        n,
        k,
        e,
        topk,
        x.stride(0),
        stride_xsk,
        w_bytes.stride(0),
        w_bytes.stride(1),
        block_scale.stride(0),
        block_scale.stride(1),
        y.stride(0),
        BN=c.bn,
        BM=c.bm,
        QUANTIZED=c.quantized,
        **routed_flags(e, src, gated, scatter),
        **cfg,
    )
    return y


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantized per 1x128: E4M3 bytes (rows padded) and fp32 scales of stride 1 along rows. The interpreter
    takes the torch reference (its own fp8 cast rounds twice)."""
    if _interpreting():
        q, scale = quantize_1x128(x)
        return q.view(torch.uint8), scale.t().contiguous().t()
    q, scale = quantize_1x128_padded(x)
    return q.view(torch.uint8), scale
