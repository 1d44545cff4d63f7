"""MXFP8 (OCP Microscaling v1.0): quantize / dequantize along the last dimension.

Every run of ``BLOCK_SIZE`` (32) consecutive elements along the last dimension shares one E8M0 scale: a uint8 biased
exponent, 127 = 2^0, 0 = 2^-127, 255 = NaN. Elements are FP8 E4M3 (max 448) or E5M2 (max 57344).

Scale rules (computed on the fp32 value of the block's largest magnitude, ``amax``):

* ``floor`` (OCP v1.0): ``2^(floor(log2 amax) - emax)``, where ``floor(log2 amax)`` is read from amax's fp32 exponent
  bits and ``emax`` is the element format's largest exponent (8 for E4M3, 15 for E5M2). Elements that then exceed
  the element max saturate to it.
* ``rceil`` (NVIDIA / cuBLAS): ``amax / max_elem`` in fp32, rounded up to a power of two.
* ``compressed-tensors`` (its MXFP8 quantization, E4M3 only): ``amax`` rounded up to the next power of two when its
  mantissa is 1.75 or more, then ``2^-8``. It differs from ``rceil`` only where the mantissa is exactly 1.75.

All clamp the exponent to [-127, 127]. A block holding NaN or +-inf gets scale 255, so it dequantizes to NaN; an
all-zero block gets scale 0 and dequantizes to zeros. Elements are ``x / scale`` clamped to +-max_elem and rounded
to nearest even.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "BLOCK_SIZE",
    "E8M0_BIAS",
    "E8M0_NAN",
    "ELEM_DTYPES",
    "MXFP8",
    "SCALE_DTYPES",
    "SCALE_MODES",
    "ElementType",
    "Format",
    "MXTensor",
    "ScaleMode",
    "dequantize",
    "e8m0_bytes",
    "e8m0_to_float32",
    "nonfinite_reason",
    "quantize",
]

ScaleMode = Literal["floor", "rceil", "compressed-tensors"]
SCALE_MODES = ("floor", "rceil", "compressed-tensors")
SCALE_DTYPES = (torch.uint8, *([torch.float8_e8m0fnu] if hasattr(torch, "float8_e8m0fnu") else []))
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ElementType:
    """An element encoding: its dtype, its largest finite magnitude, the exponent of the largest power of two at or
    below that, and its mantissa bits."""

    dtype: torch.dtype
    max: float
    emax: int
    mantissa_bits: int


@dataclass(frozen=True)
class Format:
    """A block-scaled format: each run of ``block_size`` consecutive elements along the last dimension shares one
    scale, a biased power-of-two exponent byte (``scale_bias`` is 2^0, ``scale_nan`` NaN) stored as one of
    ``scale_dtypes``, computed by one of ``scale_modes``; elements of one of ``elements``. ``compressed_tensors`` and
    ``modelopt`` are the names compressed-tensors' ``format`` and ModelOpt's ``quant_algo`` give its checkpoints."""

    name: str
    block_size: int
    elements: tuple[ElementType, ...]
    scale_dtypes: tuple[torch.dtype, ...]
    scale_bias: int
    scale_nan: int
    scale_modes: tuple[str, ...]
    compressed_tensors: str
    modelopt: str

    def element(self, dtype: torch.dtype) -> ElementType:
        """The element encoding of ``dtype``; TypeError naming the format's where it has none."""
        for e in self.elements:
            if e.dtype == dtype:
                return e
        names = " or ".join(str(e.dtype).removeprefix("torch.") for e in self.elements)
        raise TypeError(f"{self.name} elements must be {names}, got {dtype}")

    def check_pair(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        """Raise TypeError/ValueError unless ``(qdata, scale)`` is a well-formed pair of this format: elements
        ``[..., K]``, scales ``[..., K / block_size]`` on the same device."""
        self.element(qdata.dtype)
        if scale.dtype not in self.scale_dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in self.scale_dtypes)
            raise TypeError(f"{self.name} scales must be {names} (E8M0 biased exponents), got {scale.dtype}")
        if qdata.dim() == 0 or qdata.shape[-1] % self.block_size:
            raise ValueError(
                f"the last dimension of MX data must be a multiple of {self.block_size}, got shape {tuple(qdata.shape)}"
            )
        want = (*qdata.shape[:-1], qdata.shape[-1] // self.block_size)
        if tuple(scale.shape) != want:
            raise ValueError(
                f"scale shape {tuple(scale.shape)} does not match data shape {tuple(qdata.shape)}: expected {want}"
            )
        if qdata.device != scale.device:
            raise ValueError(f"data is on {qdata.device} but scale is on {scale.device}")


E4M3 = ElementType(torch.float8_e4m3fn, 448.0, 8, 3)
E5M2 = ElementType(torch.float8_e5m2, 57344.0, 15, 2)
MXFP8 = Format(
    "MXFP8",
    32,
    (E4M3, E5M2),
    SCALE_DTYPES,
    127,
    255,
    SCALE_MODES,
    compressed_tensors="mxfp8-quantized",
    modelopt="MXFP8",
)
"""MX FP8 (OCP Microscaling v1.0), the format mxgemm implements: blocks of 32, E8M0 scales, E4M3 or E5M2 elements."""

# MXFP8's description as the constants its kernels and callers read
BLOCK_SIZE = MXFP8.block_size
E8M0_BIAS = MXFP8.scale_bias
E8M0_NAN = MXFP8.scale_nan
# element dtype -> (largest finite value, exponent of the largest power of two below it)
ELEM_DTYPES: dict[torch.dtype, tuple[float, int]] = {e.dtype: (e.max, e.emax) for e in MXFP8.elements}


@dataclass(frozen=True)
class MXTensor:
    """An MX-quantized tensor: ``qdata`` (float8, shape [..., K]) and ``scale`` (uint8 E8M0, shape [..., K/32])."""

    qdata: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        check_mx_pair(self.qdata, self.scale)
        object.__setattr__(self, "scale", e8m0_bytes(self.scale))

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape

    @property
    def elem_dtype(self) -> torch.dtype:
        return self.qdata.dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)


def check_mx_pair(qdata: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless ``(qdata, scale)`` is a well-formed MX pair (:meth:`Format.check_pair`)."""
    MXFP8.check_pair(qdata, scale)


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as mxgemm keeps them, uint8 biased exponents: a ``torch.float8_e8m0fnu`` tensor (torchao's and
    PyTorch's E8M0 dtype, the same bytes) is viewed as uint8, a uint8 one returned as it is."""
    return scale if scale.dtype == torch.uint8 else scale.view(torch.uint8)


def nonfinite_reason(qdata: torch.Tensor, scale: torch.Tensor) -> str:
    """Why the MX pair (E4M3 elements ``[..., K]``, uint8 scales ``[..., K/32]``) does not dequantize to finite fp32
    values, or "" where it does: a scale of 255 (E8M0's NaN), a NaN element, or a block whose largest element times
    its scale overflows. Reads the elements' bytes, no full-precision copy."""
    nan = (scale == E8M0_NAN).nonzero()
    if len(nan):
        return f"holds the E8M0 NaN code 255 at {tuple(nan[0].tolist())} ({len(nan)} in all)"
    magnitude = qdata.view(torch.uint8) & 0x7F  # E4M3 is sign and magnitude: larger codes, larger values
    nan = (magnitude == 0x7F).nonzero()
    if len(nan):
        return f"holds a NaN element at {tuple(nan[0].tolist())} ({len(nan)} in all)"
    codes = magnitude.reshape(*magnitude.shape[:-1], -1, BLOCK_SIZE).amax(-1).long()
    values = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).double().to(codes.device)[codes]
    largest = values * torch.exp2(scale.double() - E8M0_BIAS)
    big = (largest > torch.finfo(torch.float32).max).nonzero()
    if len(big):
        return f"dequantizes to infinity in the block at {tuple(big[0].tolist())} ({len(big)} blocks in all)"
    return ""


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """Exact fp32 value of E8M0 biased exponents: 2^(s-127); 0 -> 2^-127 (an fp32 subnormal); 255 -> NaN."""
    s = scale.to(torch.int32)
    value = (s << 23).view(torch.float32)
    value = torch.where(s == 0, 2.0**-127, value)  # Python scalars: no host-to-device copy (graph-capture safe)
    return torch.where(s == E8M0_NAN, float("nan"), value)


def _biased_exponent_floor(amax: torch.Tensor, emax: int) -> torch.Tensor:
    exp = ((amax.view(torch.int32) >> 23) & 0xFF) - E8M0_BIAS  # floor(log2 amax); fp32 subnormals/zero read -127
    return (exp - emax).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS


def _biased_exponent_rceil(amax: torch.Tensor, max_elem: float) -> torch.Tensor:
    descale = amax / max_elem
    bits = descale.view(torch.int32)
    exp, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    # round up to a power of two; in the subnormal range, values up to 2^-127 (mantissa 0x400000) round to 2^-127
    biased = torch.where(exp == 0, (mant > 0x400000).to(torch.int32), exp + (mant != 0).to(torch.int32))
    return biased.clamp(0, 2 * E8M0_BIAS)


def _biased_exponent_compressed_tensors(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """compressed-tensors' MXFP8 rule (``generate_mx_scales``): amax rounded up to the next power of two when its
    mantissa is 1.75 or more (adding half of FP4's last mantissa step to the float's bits), then 2^-emax."""
    rounded = ((amax.view(torch.int32) + (1 << 21)) >> 23) & 0xFF  # the biased exponent after rounding
    return (rounded - emax).clamp(0, 2 * E8M0_BIAS)


def quantize(
    x: torch.Tensor, *, scale_mode: ScaleMode = "floor", elem_dtype: torch.dtype = torch.float8_e4m3fn
) -> MXTensor:
    """Quantize ``x`` to MX along its last dimension, blocks of 32; bit-exact to the rules in the module docstring."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"quantize takes a float32, bfloat16 or float16 tensor, got {got}")
    if elem_dtype not in ELEM_DTYPES:
        raise TypeError(f"elem_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {elem_dtype}")
    element = MXFP8.element(elem_dtype)
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"the last dimension must be a multiple of {BLOCK_SIZE} to quantize, got shape {tuple(x.shape)}"
        )
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {', '.join(SCALE_MODES)}, got {scale_mode!r}")
    if scale_mode == "compressed-tensors" and elem_dtype != torch.float8_e4m3fn:
        raise ValueError("scale_mode 'compressed-tensors' is defined for E4M3 elements (MXFP8) only")
    max_elem, emax = element.max, element.emax
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    amax = blocks.abs().amax(dim=-1)
    if scale_mode == "floor":
        biased = _biased_exponent_floor(amax, emax)
    elif scale_mode == "rceil":
        biased = _biased_exponent_rceil(amax, max_elem)
    else:
        biased = _biased_exponent_compressed_tensors(amax, emax)
    biased = torch.where(torch.isfinite(amax), biased, E8M0_NAN)
    scale = biased.to(torch.uint8)
    limit = element_limit(biased, max_elem, element.mantissa_bits).unsqueeze(-1)
    q = torch.minimum(torch.maximum(blocks / e8m0_to_float32(scale).unsqueeze(-1), -limit), limit)
    return MXTensor(q.to(elem_dtype).reshape(x.shape), scale)


def element_limit(biased: torch.Tensor, max_elem: float, mbits: int) -> torch.Tensor:
    """The largest element magnitude a block with biased scale exponent ``biased`` may hold: the element format's
    max, or, for scales of 2^120 and up, the largest element whose value stays below fp32's overflow
    (``2^(255 - biased) * (1 - 2^-(mbits+1))``, the element just below that power of two), so that no finite input
    dequantizes to infinity (with ``rceil``, amax near fp32's max gets scale 2^120 and elements up to 256)."""
    top = torch.exp2((255 - biased.to(torch.int32)).float()) * (1 - 2.0 ** -(mbits + 1))  # inf below 2^128 scales
    return top.clamp(max=max_elem)


def dequantize(t: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qdata * 2^(scale-127)``, computed exactly in fp32, then cast to ``dtype`` (a floating-point dtype)."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dequantize gives a floating-point tensor; dtype={dtype} is not a floating-point dtype")
    q = t.qdata.float()
    blocks = q.reshape(*q.shape[:-1], q.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    return (blocks * e8m0_to_float32(t.scale).unsqueeze(-1)).reshape(q.shape).to(dtype)
