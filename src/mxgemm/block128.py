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

from .format import BLOCK_SIZE, E8M0_NAN, check_mx_pair, e8m0_bytes, e8m0_to_float32
from .layouts import round_up

__all__ = [
    "BLOCK128_ROWS",
    "GROUP",
    "Block128Weight",
    "ReencodeReport",
    "block128_to_mx",
    "dequantize_1x128",
    "dequantize_block128",
    "grouped_block128_to_mx",
    "padded_1x128_shape",
    "prepare_block128",
    "prepare_grouped_block128",
    "quantize_1x128",
    "reencode_block128",
]

GROUP = 128
FP8_MAX = 448.0
# cuBLASLt's blockwise GEMM (measured on the H200): M in multiples of 4 (the 1x128 scales' leading dimension must be
# 16-byte aligned) and K in multiples of 512 (K blocks in fours; other counts give wrong results or errors).
CUBLASLT_M_ALIGN = 4
CUBLASLT_K_ALIGN = 512
N_ALIGN = 16  # rows of a prepared weight: cuBLASLt's and the hand-written kernels' tiles
# Output rows per row of each prepared tensor (JoinsRows.row_layout): one per element row, 128 per block-scale row.
BLOCK128_ROWS = {"qdata": 1, "block_scale": GROUP}


def padded_1x128_shape(m: int, k: int, rows_multiple: int = 1) -> tuple[int, int]:
    """(Mp, Kp): the activation shape the 1x128 quantizers write for cuBLASLt and the FP8 kernel, padded with zeros:
    M rounded up to cuBLASLt's row alignment and to ``rows_multiple`` (whole token tiles), K to its K alignment."""
    if rows_multiple < 1 or (rows_multiple > 1 and rows_multiple % CUBLASLT_M_ALIGN):
        raise ValueError(f"rows_multiple must be 1 or a multiple of {CUBLASLT_M_ALIGN}, got {rows_multiple}")
    mp = -(-m // CUBLASLT_M_ALIGN) * CUBLASLT_M_ALIGN
    return -(-mp // rows_multiple) * rows_multiple, -(-k // CUBLASLT_K_ALIGN) * CUBLASLT_K_ALIGN


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


def reencode_block128(qdata: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> Block128Weight:
    """Re-encode an MXFP8 E4M3 weight ``[N, K]`` to FP8 with one power-of-two scale per 128x128 block.

    Works through 128-row groups in chunks of about ``_CHUNK_ELEMENTS`` elements, so its fp32 temporaries stay small
    (a few hundred MiB at most) whatever the weight's size. ``out``: where to write the re-encoded elements, a float8
    ``[>= N, >= K]`` tensor (e.g. a padded buffer; the returned ``qdata`` is then its ``[N, K]`` view)."""
    check_mx_pair(qdata, scale)
    scale = e8m0_bytes(scale)
    if qdata.dtype != torch.float8_e4m3fn or qdata.dim() != 2:
        raise ValueError(f"expected a 2-D float8_e4m3fn weight, got {qdata.dtype} with shape {tuple(qdata.shape)}")
    n, k = qdata.shape
    if out is None:
        out = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=qdata.device)
    if out.dtype != torch.float8_e4m3fn or out.shape[0] < n or out.shape[1] < k:
        raise ValueError(f"out must be float8_e4m3fn of at least [{n}, {k}], got {out.dtype} {tuple(out.shape)}")
    kb = k // BLOCK_SIZE
    nb, kg = -(-n // GROUP), -(-kb // _SCALES_PER_GROUP)
    block_e = torch.empty((nb, kg), dtype=torch.int32, device=qdata.device)
    changed = max_shift = 0
    ref_sq = err_sq = 0.0
    rows = max(GROUP, _CHUNK_ELEMENTS // max(k, 1) // GROUP * GROUP)
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        c = _reencode_rows(qdata[r0:r1], scale[r0:r1], out[r0:r1, :k])
        block_e[r0 // GROUP : -(-r1 // GROUP)] = c.block_e
        changed, max_shift = changed + c.changed, max(max_shift, c.max_shift)
        ref_sq, err_sq = ref_sq + c.ref_sq, err_sq + c.err_sq
    ref_norm = ref_sq**0.5
    report = ReencodeReport(
        elements=n * k,
        changed=changed,
        max_shift=max_shift,
        rel_error=err_sq**0.5 / ref_norm if ref_norm > 0 else 0.0,
    )
    return Block128Weight(out[:n, :k], e8m0_to_float32(block_e.to(torch.uint8)), report)


def prepare_block128(qdata: torch.Tensor, scale: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """The stored form of a 128x128-block weight: fp8 ``qdata`` ``[Np, Kp]`` (zero padded: N to ``N_ALIGN``, K to
    ``CUBLASLT_K_ALIGN``) and fp32 ``block_scale`` ``[Np/128, Kp/128]`` (padding scales 1), re-encoded straight into
    the padded buffer; the info holds the exactness report (``"reencode"``)."""
    n, k = qdata.shape
    np_, kp = round_up(n, N_ALIGN), round_up(k, CUBLASLT_K_ALIGN)
    q = torch.zeros((np_, kp), dtype=torch.uint8, device=qdata.device).view(torch.float8_e4m3fn)
    block = reencode_block128(qdata, scale, out=q)
    nb = -(-np_ // GROUP)
    s = F.pad(block.scale, (0, kp // GROUP - block.scale.shape[1], 0, nb - block.scale.shape[0]), value=1.0)
    return {"qdata": q, "block_scale": s.contiguous()}, {"reencode": block.report}


def prepare_grouped_block128(qdata: torch.Tensor, scale: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """The stored form of the 128x128-block weights of E experts, ``[E, N, K]``: fp8 ``qdata`` ``[E, N, K]`` and fp32
    ``block_scale`` ``[E, ceil(N/128), ceil(K/128)]``, each expert re-encoded straight into its slice (no padding:
    the grouped kernels mask edges); the info holds the report of the expert the re-encoding changes most."""
    e = qdata.shape[0]
    out = torch.empty(qdata.shape, dtype=torch.float8_e4m3fn, device=qdata.device)
    blocks = [reencode_block128(qdata[i], scale[i], out=out[i]) for i in range(e)]
    report = max((b.report for b in blocks), key=lambda r: r.rel_error)
    return {"qdata": out, "block_scale": torch.stack([b.scale for b in blocks])}, {"reencode": report}


def grouped_block128_to_mx(qdata: torch.Tensor, block_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block128_to_mx` of each expert of :func:`prepare_grouped_block128`'s tensors, stacked."""
    _, n, k = qdata.shape
    pairs = [block128_to_mx(q, s, n, k) for q, s in zip(qdata, block_scale, strict=True)]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


_CHUNK_ELEMENTS = 1 << 23  # 8Mi elements a chunk: about 200 MiB of fp32 temporaries


@dataclass(frozen=True)
class _Chunk:
    block_e: torch.Tensor  # [row groups, kg] int32
    changed: int
    max_shift: int
    ref_sq: float
    err_sq: float


def _reencode_rows(qdata: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> _Chunk:
    """Re-encode rows that start a 128-row group (the last group may be short) into ``out``."""
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
    out.copy_(new_q)

    # exactness: compare the values the two encodings stand for (in fp32: each is an exact fp8 x power of two)
    old_v = (q32 * e8m0_to_float32(scale).unsqueeze(-1)).reshape(n, k)
    new_v = new_q.float() * e8m0_to_float32(e_per_32.to(torch.uint8)).repeat_interleave(BLOCK_SIZE, 1)
    finite = torch.isfinite(old_v)
    changed = finite & (old_v != new_v)
    return _Chunk(
        block_e=block_e,
        changed=int(changed.sum().item()),
        max_shift=int(shift.max().item()) if shift.numel() else 0,
        ref_sq=old_v[finite].double().square().sum().item(),
        err_sq=(new_v[changed].double() - old_v[changed].double()).square().sum().item(),
    )


def block128_to_mx(qdata: torch.Tensor, block_scale: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 128x128-block weight as the MX checkpoint tensors it equals: (float8 ``[n, k]``, uint8 E8M0 ``[n, k/32]``).

    A block's power-of-two scale is an E8M0 exponent shared by its 32-blocks, so this is exact: the pair dequantizes
    to the same values as :func:`dequantize_block128`. ``qdata`` may be padded (``[>= n, >= k]``); the first tensor is
    a view of it when it is contiguous along K."""
    # 2^(E-127) in fp32 has E in its exponent field: normal for E >= 1, the subnormal 2^-127 (field 0) for E = 0
    e = ((block_scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    scale = e.repeat_interleave(GROUP, 0).repeat_interleave(_SCALES_PER_GROUP, 1)[:n, : k // BLOCK_SIZE]
    return qdata[:n, :k], scale.contiguous()
