"""The ``w8a8-block`` recipe's formats: FP8 with FP32 scales per 1x128 (activations) and per 128x128 (weights).

Activations: each row's run of 128 elements along K (the last run may be shorter) gets ``scale = amax / 448`` in fp32
and elements ``x * (448 / amax)`` clamped to +-448, rounded to nearest even E4M3. ``amax`` is floored at
``AMAX_FLOOR`` = 2^-64, so all-zero runs get a tiny positive scale and ``448 / amax`` stays finite.

Weights: an MXFP8 weight is re-encoded, not re-quantized. Each 128x128 block takes the largest E8M0 exponent ``E`` of
its 32-element blocks as its power-of-two scale ``2^(E-127)``; every element moves to ``q * 2^(s-E)``, rounded to
E4M3. That shift is exact unless the element falls into E4M3's subnormal range; :class:`ReencodeReport` counts the
elements it changed and how much. Blocks whose MX scale is NaN (255) stay NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .format import BLOCK_SIZE, E8M0_NAN, check_mx_pair, e8m0_to_float32

__all__ = [
    "GROUP",
    "Block128Weight",
    "ReencodeReport",
    "dequantize_1x128",
    "dequantize_block128",
    "quantize_1x128",
    "reencode_block128",
]

GROUP = 128
FP8_MAX = 448.0
# cuBLASLt's blockwise GEMM (measured on the H200): M in multiples of 4 (the 1x128 scales' leading dimension must be
# 16-byte aligned) and K in multiples of 512 (K blocks in fours; other counts give wrong results or errors).
CUBLASLT_M_ALIGN = 4
CUBLASLT_K_ALIGN = 512


def padded_1x128_shape(m: int, k: int) -> tuple[int, int]:
    """(Mp, Kp): the activation shape the 1x128 quantizer writes for cuBLASLt, padded with zeros."""
    return -(-m // CUBLASLT_M_ALIGN) * CUBLASLT_M_ALIGN, -(-k // CUBLASLT_K_ALIGN) * CUBLASLT_K_ALIGN


AMAX_FLOOR = 2.0**-64
_SCALES_PER_GROUP = GROUP // BLOCK_SIZE


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (K % 32 == 0) -> (float8_e4m3fn [M, K], float32 scales [M, ceil(K/128)])."""
    m, k = x.shape
    groups = -(-k // GROUP)
    xf = F.pad(x.float(), (0, groups * GROUP - k)).reshape(m, groups, GROUP)
    amax = xf.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    # tensor / tensor: one IEEE division (torch turns `448 / t` into reciprocal * 448, and divides by a scalar via
    # its reciprocal on CUDA: two roundings, which kernels do not reproduce)
    fp8_max = torch.full_like(amax, FP8_MAX)
    q = (xf * (fp8_max / amax).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, groups * GROUP)[:, :k], amax / fp8_max


def dequantize_1x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact fp32 value of a 1x128-scaled FP8 tensor."""
    return q.float() * scale.repeat_interleave(GROUP, dim=1)[:, : q.shape[1]]


@dataclass(frozen=True)
class ReencodeReport:
    """How far a 128x128 re-encoding is from the MX weight it came from."""

    elements: int
    changed: int  # elements whose value differs from the MX weight
    max_shift: int  # largest exponent shift applied to a 32-block (E - s)
    rel_error: float  # ||W_block - W_mx|| / ||W_mx|| over finite elements

    @property
    def changed_fraction(self) -> float:
        return self.changed / max(self.elements, 1)

    def __str__(self) -> str:
        return (
            f"{self.changed}/{self.elements} elements changed ({100 * self.changed_fraction:.4f}%), "
            f"max shift {self.max_shift}, relative error {self.rel_error:.3g}"
        )


@dataclass(frozen=True)
class Block128Weight:
    qdata: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [ceil(N/128), ceil(K/128)], powers of two
    report: ReencodeReport

    def dequantize(self) -> torch.Tensor:
        return dequantize_block128(self.qdata, self.scale)


def dequantize_block128(qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Exact fp32 value of FP8 ``[N, K]`` with one fp32 scale per 128x128 block (``scale`` may have extra columns)."""
    n, k = qdata.shape
    return qdata.float() * scale.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)[:n, :k]


def reencode_block128(qdata: torch.Tensor, scale: torch.Tensor) -> Block128Weight:
    """Re-encode an MXFP8 E4M3 weight ``[N, K]`` to FP8 with one power-of-two scale per 128x128 block."""
    check_mx_pair(qdata, scale)
    if qdata.dtype != torch.float8_e4m3fn or qdata.dim() != 2:
        raise ValueError(f"expected a 2-D float8_e4m3fn weight, got {qdata.dtype} with shape {tuple(qdata.shape)}")
    n, k = qdata.shape
    kb = k // BLOCK_SIZE
    nb, kg = -(-n // GROUP), -(-kb // _SCALES_PER_GROUP)
    s = scale.to(torch.int32)
    finite_s = torch.where(s == E8M0_NAN, 0, s)
    padded = F.pad(finite_s, (0, kg * _SCALES_PER_GROUP - kb, 0, nb * GROUP - n))
    block_e = padded.reshape(nb, GROUP, kg, _SCALES_PER_GROUP).amax(dim=(1, 3))  # [nb, kg]
    e_per_32 = block_e.repeat_interleave(GROUP, 0).repeat_interleave(_SCALES_PER_GROUP, 1)[:n, :kb]
    shift = e_per_32 - finite_s  # >= 0
    q32 = qdata.float().reshape(n, kb, BLOCK_SIZE)
    moved = q32 * torch.exp2(-shift.float()).unsqueeze(-1)  # exact: a power-of-two scaling in fp32
    nan_block = (s == E8M0_NAN).unsqueeze(-1)
    new_q = torch.where(nan_block, float("nan"), moved).to(torch.float8_e4m3fn).reshape(n, k)
    block_scale = e8m0_to_float32(block_e.to(torch.uint8))

    # exactness: compare the values the two encodings stand for (in fp32: each is an exact fp8 x power of two)
    old_v = (q32 * e8m0_to_float32(scale).unsqueeze(-1)).reshape(n, k)
    new_v = new_q.float() * e8m0_to_float32(e_per_32.to(torch.uint8)).repeat_interleave(BLOCK_SIZE, 1)
    finite = torch.isfinite(old_v)
    changed = finite & (old_v != new_v)
    ref_norm = old_v[finite].double().norm().item()
    err_norm = (new_v[changed].double() - old_v[changed].double()).norm().item()
    report = ReencodeReport(
        elements=n * k,
        changed=int(changed.sum().item()),
        max_shift=int(shift.max().item()) if shift.numel() else 0,
        rel_error=err_norm / ref_norm if ref_norm > 0 else 0.0,
    )
    return Block128Weight(new_q, block_scale, report)
