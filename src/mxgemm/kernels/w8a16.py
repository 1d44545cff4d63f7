"""Triton kernel: ``y = x @ dequant(W)^T (+ bias)`` reading MXFP8 weights (fp8 bytes + E8M0 scales) directly.

Exact ``w8a16``: every weight element is decoded to its exact value ``q * 2^(s-127)`` (representable in bf16 and in
tf32) and multiplied on tensor cores with fp32 accumulation. bf16 activations use a bf16 dot; fp16 activations use
a tf32 dot, which holds every fp16 value exactly (bf16 would round them).

Shape of the computation (swap-AB): each program computes ``acc[BN, BM] = W_tile[BN, BK] @ x_tile^T[BK, BM]`` so
that the decoded weight is the dot's left operand, which Hopper's wgmma reads straight from registers; the output
tile is stored transposed. ``SPLIT_K > 1`` splits K across programs for small M; partial sums go to an fp32
workspace and the last program of each output tile (an atomic counter says which) adds them in a fixed order, so
results are deterministic, and resets the counter for the next launch.

Decoding: by default the hardware fp8 -> fp32 conversion and an fp32 multiply by the scale (the fastest at small M
on the H200). ``PACKED`` (E4M3 with scales <= 134, the fastest at large M): inline PTX turns four E4M3 bytes into
four bf16 equal to the values times 2^-120, then one packed bf16 multiply by 2^(s-7) per pair. ``BLOCK_SCALED``:
the weight has one fp32 power-of-two scale per 128x128 block instead (the ``w8a8-block`` weight). NaN elements are
handled at preparation (their 32-block's scale becomes NaN, which leaves every output unchanged). The other
decoders measured, and why they lost, are in docs/performance.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["W8A16Config", "default_config", "w8a16_linear"]

_TWO_POW_M127 = tl.constexpr(5.877471754111438e-39)  # 2^-127, an fp32 subnormal


@triton.jit
def _scale_f32(s, PLAIN_SCALES: tl.constexpr = False):
    """uint8 E8M0 -> exact fp32 2^(s-127); 0 -> 2^-127, 255 -> NaN. With PLAIN_SCALES the caller guarantees
    1 <= s <= 254, where the fp32 bits are just ``s << 23``."""
    s32 = s.to(tl.int32)
    sf = (s32 << 23).to(tl.float32, bitcast=True)
    if not PLAIN_SCALES:
        sf = tl.where(s32 == 0, _TWO_POW_M127, sf)
        sf = tl.where(s32 == 255, float("nan"), sf)
    return sf


@triton.jit
def _fp8_to(w, dtype: tl.constexpr, E5M2: tl.constexpr):
    if E5M2:
        return w.to(tl.float8e5, bitcast=True).to(dtype)
    return w.to(tl.float8e4nv, bitcast=True).to(dtype)


@triton.jit
def _e4m3x4_to_bf16_times_2_pow_m120(w):
    """Four E4M3 bytes per 32-bit register -> four bf16 equal to the values times 2^-120 (exact, subnormals too).

    ``seeeemmm`` becomes the bf16 bits ``s0000eeeemmm0000``: bf16's exponent bias is 120 more than E4M3's, and its
    subnormals line up with E4M3's the same way. prmt puts each byte in the high half of a 16-bit lane; the
    exponent-mantissa bits shift down by 4 while the sign stays.
    """
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, u0, u1;
        prmt.b32 t0, $2, 0, 0x1404;
        prmt.b32 t1, $2, 0, 0x3424;
        shr.b32 u0, t0, 4;
        shr.b32 u1, t1, 4;
        and.b32 u0, u0, 0x07F007F0;
        and.b32 u1, u1, 0x07F007F0;
        lop3.b32 $0, t0, 0x80008000, u0, 0xEA;
        lop3.b32 $1, t1, 0x80008000, u1, 0xEA;
        }""",
        constraints="=r,=r,r",
        args=[w],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _scale_bf16_times_2_pow_120(s):
    """uint8 E8M0 -> bf16 2^(s-127+120) = 2^(s-7), exact for s <= 134; 255 -> NaN."""
    s16 = s.to(tl.int16)
    sb = ((s16 + 120) << 7).to(tl.bfloat16, bitcast=True)
    return tl.where(s16 == 255, float("nan"), sb)


@triton.jit
def _decode(
    w, s, BN: tl.constexpr, BK: tl.constexpr, E5M2: tl.constexpr, PACKED: tl.constexpr, PLAIN_SCALES: tl.constexpr
):
    """uint8 weights [BN, BK] and scales [BN, BK // 32] -> exact values [BN, BK] (bf16 if PACKED, else fp32)."""
    if PACKED:  # E4M3 only, scales <= 134 (checked at preparation)
        wb = tl.reshape(_e4m3x4_to_bf16_times_2_pow_m120(w), (BN, BK // 32, 32))
        wf = wb * _scale_bf16_times_2_pow_120(s)[:, :, None]
    else:
        wf = tl.reshape(_fp8_to(w, tl.float32, E5M2), (BN, BK // 32, 32)) * _scale_f32(s, PLAIN_SCALES)[:, :, None]
    return tl.reshape(wf, (BN, BK))


@triton.jit
def _dot(w, xt, acc, X_FP16: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + w @ xt with w exact; bf16 dot for bf16 activations, tf32 for fp16 (exact for fp16 values)."""
    if DOT_FP32:  # the Triton interpreter's bf16 dot is broken; fp32 gives the same exact products
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    elif X_FP16:
        return tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="tf32")
    else:
        return tl.dot(w.to(tl.bfloat16), xt, acc)


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_sn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    E5M2: tl.constexpr,
    X_FP16: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PACKED: tl.constexpr,
    PLAIN_SCALES: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BN + tl.arange(0, BN)
    rm = pid_m * BM + tl.arange(0, BM)
    n_ok = rn < N
    m_ok = rm < M
    k_begin = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    rk = tl.arange(0, BK)
    rks = tl.arange(0, BK // 32)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BK):
        w_ptrs = w_ptr + rn[:, None] * stride_wn + (k0 + rk)[None, :]
        s_ptrs = s_ptr + rn[:, None] * stride_sn + (k0 // 32 + rks)[None, :]
        x_ptrs = x_ptr + rm[None, :] * stride_xm + (k0 + rk)[:, None] * stride_xk
        if EVEN_K:  # every K tile is whole: only the N and M edges need masks
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            if not BLOCK_SCALED:
                s = tl.load(s_ptrs, mask=n_ok[:, None], other=127)
        else:
            k_ok = (k0 + rk) < k_end
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if not BLOCK_SCALED:
                s = tl.load(s_ptrs, mask=n_ok[:, None] & ((k0 + rks * 32) < k_end)[None, :], other=127)
        if BLOCK_SCALED:  # one fp32 power-of-two scale per 128x128 block: a scalar for this tile
            sc = tl.load(s_ptr + (pid_n * BN // 128) * stride_sn + k0 // 128)
            wv = _fp8_to(w, tl.float32, E5M2) * sc
        else:
            wv = _decode(w, s, BN, BK, E5M2, PACKED, PLAIN_SCALES)
        acc = _dot(wv, xt, acc, X_FP16, DOT_FP32)

    if SPLIT_K > 1:
        # publish this split's partial tile, count arrivals; the last program reduces in split order
        tile = pid_m * tl.num_programs(0) + pid_n
        ws_tile = ws_ptr + tile * (SPLIT_K * BN * BM) + tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
        tl.store(ws_tile + pid_k * (BN * BM), acc, cache_modifier=".cg")
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
            for i in range(SPLIT_K):
                acc += tl.load(ws_tile + i * (BN * BM), cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0)
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(
                y_ptr + rm[None, :] * stride_ym + rn[:, None],
                acc.to(y_ptr.dtype.element_ty),
                mask=m_ok[None, :] & n_ok[:, None],
            )
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(
            y_ptr + rm[None, :] * stride_ym + rn[:, None],
            acc.to(y_ptr.dtype.element_ty),
            mask=m_ok[None, :] & n_ok[:, None],
        )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, needed: int) -> torch.Tensor:
    """Zeroed int32 arrival counters, one per output tile; kernels leave them zeroed again."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < needed:
        buf = torch.zeros(max(needed, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


@dataclass(frozen=True)
class W8A16Config:
    """A launch of the kernel: ``bn`` x ``bm`` output tiles (weight rows x tokens), ``bk``-deep K steps, ``split_k``
    programs along K, the ``packed`` decoder, ``warps`` and ``stages`` (Triton's ``num_warps``, ``num_stages``)."""

    bn: int = 64
    bm: int = 16
    bk: int = 128
    split_k: int = 1
    packed: bool = False
    warps: int = 4
    stages: int = 3

    def valid(self, k: int, block_scaled: bool = False) -> bool:
        """Power-of-two tiles of 16-256 (``bk`` from 32), 4 or 8 warps, 1-5 stages, at least one split; a block-scaled
        weight needs 128-deep steps and a ``bn`` dividing 128."""
        pow2 = all(v & (v - 1) == 0 for v in (self.bn, self.bm, self.bk))
        sizes = 16 <= self.bn <= 256 and 16 <= self.bm <= 256 and 32 <= self.bk <= 256 and self.warps in (4, 8)
        steps = self.split_k >= 1 and self.stages in range(1, 6)
        return pow2 and sizes and steps and (not block_scaled or (self.bk == 128 and 128 % self.bn == 0))

    def fills_splits(self, k: int) -> bool:
        """Whether every K split gets at least one whole ``bk`` step of a K-deep weight (the variants worth timing;
        a config that leaves splits idle is valid but slower)."""
        return k >= self.split_k * self.bk


def default_config(
    m: int, n: int, k: int, *, packed_decode: bool = False, block_scaled: bool = False, multiprocessors: int = 132
) -> W8A16Config:
    """The best configs measured on the H200 (the default of both backends that run this kernel); valid for every
    shape with K >= 32. ``packed_decode``: the weight allows the packed decoder (E4M3, scales <= 134), the fastest at
    large M. ``block_scaled``: a 128x128-block weight, whose tiles must be 128 deep and at most 128 wide (small-M
    tiles at every M)."""
    if m <= 16:
        bn, bm, bk, warps, packed = 64, 16, 128, 4, False
    elif m <= 64 or block_scaled:
        bn, bm, bk, warps, packed = 64, 64 if m > 32 else 32, 128, 4, False
    else:
        bn, bm, bk, warps, packed = 128, 128, 64, 8, packed_decode
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    split = 1
    while tiles * split < 2 * multiprocessors and k // (split * 2) >= 4 * bk:
        split *= 2
    return W8A16Config(bn, bm, bk, split, packed, warps, 3)


def w8a16_linear(
    x: torch.Tensor,
    w_bytes: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    e5m2: bool = False,
    plain_scales: bool = False,
    block_scaled: bool = False,
    config: W8A16Config | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [M, K] bf16/fp16, ``w_bytes`` uint8 [N, K], ``scale`` uint8 [N, K/32] -> [M, N] in ``x.dtype``.

    ``plain_scales``: the caller guarantees every scale is in 1..254 (no 2^-127, no NaN): cheaper decoding.
    ``block_scaled``: ``scale`` is instead fp32 ``[ceil(N/128), >= ceil(K/128)]``, one power of two per 128x128 block
    (the ``w8a8-block`` weight); tiles then use BK = 128 and a BN dividing 128.
    ``config``: tile sizes, split-K and the packed decoder (default: :func:`default_config`).
    ``out``: an [M, N] tensor of ``x.dtype`` with unit column stride to write into (else a new one).
    """
    m, k = x.shape
    n = w_bytes.shape[0]
    c = config or default_config(m, n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if y.shape != (m, n) or y.dtype != x.dtype or y.stride(1) != 1:
        raise ValueError(f"out must be a {x.dtype} [{m}, {n}] tensor with unit column stride")
    if not c.valid(k, block_scaled):
        raise ValueError(f"the kernel cannot run {c} on K={k}{' (block-scaled weight)' if block_scaled else ''}")
    # the packed decoder: E4M3 MX scales, and inline PTX (no interpreter)
    packed = c.packed and not (block_scaled or e5m2 or _interpreting())
    cfg = dict(BN=c.bn, BM=c.bm, BK=c.bk, SPLIT_K=c.split_k, PACKED=packed, num_warps=c.warps)
    if not _interpreting():
        cfg["num_stages"] = c.stages
    split = c.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), c.bk) * c.bk
    grid = (triton.cdiv(n, c.bn), triton.cdiv(m, c.bm), split)
    tiles = grid[0] * grid[1]
    ws = torch.empty(tiles * split * c.bn * c.bm if split > 1 else 1, dtype=torch.float32, device=x.device)
    cnt = _counters(x.device, tiles) if split > 1 else ws
    _w8a16_kernel[grid](
        x,
        w_bytes,
        scale,
        bias if bias is not None else y,
        y,
        ws,
        cnt,
        m,
        n,
        k,
        k_per_split,
        x.stride(0),
        x.stride(1),
        w_bytes.stride(0),
        scale.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        E5M2=e5m2,
        X_FP16=x.dtype == torch.float16,
        DOT_FP32=_interpreting(),
        PLAIN_SCALES=plain_scales,
        BLOCK_SCALED=block_scaled,
        EVEN_K=k % c.bk == 0,
        **cfg,
    )
    return y
