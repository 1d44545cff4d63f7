"""``cublas_mx``: the ``w8a8-mx`` recipe through ``torch._scaled_mm`` with float8_e8m0fnu scales in 128x4 layout.

cuBLAS offers no capability query for block-scaled MX GEMMs, so availability is probed once per device with a tiny
problem (compared with its emulated twin) and cached; the error text is the reason (on an H200 cuBLAS answers
CUBLAS_STATUS_NOT_SUPPORTED). Not run on Blackwell by this project yet.

Grouped weights of a mixture of experts go through ``torch._scaled_grouped_mm`` with E8M0 scales (PyTorch's MXFP8
grouped GEMM, FBGEMM's CUTLASS kernel on SM100): each expert's scales swizzled 128x4 once, the activations' per
call, each expert's rows padded to 128 in the scale layout (:func:`mxgemm.layouts.grouped_128x4`); K a multiple of
128, where that kernel's scale offsets and the padded layout agree. Probed against the twin as the dense call is; not
run on hardware by this project yet.
"""

from __future__ import annotations

import functools

import torch

from ..availability import probe_against_twin, probe_operands, probe_preconditions
from ..device import DeviceInfo
from ..format import BLOCK_SIZE, e8m0_bytes
from ..layouts import finish_output, from_128x4, grouped_128x4, pad_rows, to_128x4
from ..recipes import MX_ACT_SCALE_MODE, Recipe
from .base import Availability, Backend, PreparedGroupedWeight, PreparedWeight, UnsupportedWeightError
from .capabilities import GroupedWeights

__all__ = ["CublasMXBackend", "probe_cublas_mx", "probe_cublas_mx_grouped"]

N_ALIGN = 16


def cublas_mx_linear(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    from ..kernels.mx_quant import mx_quantize

    xq, xs = mx_quantize(x, scale_mode=MX_ACT_SCALE_MODE, layout="128x4")
    t = weight.tensors
    e8m0 = torch.float8_e8m0fnu
    y = torch._scaled_mm(xq, t["qdata"].t(), xs.view(e8m0), t["scale"].view(e8m0), out_dtype=torch.bfloat16)
    return finish_output(y, x, bias, weight.out_features)


def cublas_mx_grouped(x: torch.Tensor, weight: PreparedGroupedWeight, offsets: torch.Tensor) -> torch.Tensor:
    """``x`` [S, K] rows sorted by expert through ``torch._scaled_grouped_mm``; rows past the last expert's end, which
    the GEMM leaves unwritten, are zeros."""
    from ..kernels.mx_quant import mx_quantize

    xq, xs = mx_quantize(x, scale_mode=MX_ACT_SCALE_MODE)
    t = weight.tensors
    e8m0 = torch.float8_e8m0fnu
    scale_a = grouped_128x4(xs, offsets).view(e8m0)
    y = torch._scaled_grouped_mm(
        xq, t["qdata"].transpose(1, 2), scale_a, t["scale"].view(e8m0), offs=offsets, out_dtype=torch.bfloat16
    )
    past = torch.arange(x.shape[0], device=x.device)[:, None] >= offsets[-1]
    return y.masked_fill(past, 0).to(x.dtype)


@functools.cache
def probe_cublas_mx_grouped(index: int) -> Availability:
    """One small grouped MX GEMM (uneven rows over 3 experts, one empty) on CUDA device ``index``, compared with its
    emulated twin (cached per device)."""

    def run():
        from .emulation import EmulationBackend

        t, x = probe_operands(index, 3 * 128, 256, 100)
        q, s = t.qdata.view(3, 128, 256), t.scale.view(3, 128, 8)
        offsets = torch.tensor([60, 60, 100], dtype=torch.int32, device=x.device)
        y = cublas_mx_grouped(x, CublasMXBackend().prepare_grouped(q, s, Recipe.W8A8_MX), offsets)
        twin = EmulationBackend()
        ref = twin.run_grouped(x, twin.prepare_grouped(q, s, Recipe.W8A8_MX), offsets)
        return y, ref.float()

    return probe_against_twin("PyTorch's MXFP8 grouped GEMM", run)


@functools.cache
def probe_cublas_mx(index: int) -> Availability:
    """One small MX GEMM on CUDA device ``index``, compared with its emulated twin (cached per device)."""

    def run():
        from .. import format as mxformat

        t, x = probe_operands(index, 128, 256, 32)
        pw = CublasMXBackend().prepare(t.qdata, t.scale, Recipe.W8A8_MX)
        ref = mxformat.dequantize(mxformat.quantize(x)) @ mxformat.dequantize(t).T
        return cublas_mx_linear(x, pw, None), ref

    return probe_against_twin("cuBLAS block-scaled MXFP8 GEMM", run)


class CublasMXBackend(Backend, GroupedWeights):
    name = "cublas_mx"
    recipes = (Recipe.W8A8_MX,)
    grouped_recipes = (Recipe.W8A8_MX,)
    summary = "torch._scaled_mm with E8M0 128x4 scales (cuBLAS block-scaled MXFP8, Blackwell)"

    def check_device(self, device: DeviceInfo) -> Availability:
        if device.type != "cuda":
            return Availability(False, f"needs a CUDA GPU; this device is {device.type}")
        if not hasattr(torch, "float8_e8m0fnu"):
            return Availability(False, f"torch {torch.__version__} has no float8_e8m0fnu dtype")
        missing = probe_preconditions(device, "cuBLAS")
        return missing if missing is not None else probe_cublas_mx(device.index)

    def prepare(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedWeight:
        if qdata.dtype != torch.float8_e4m3fn:
            raise ValueError(f"cublas_mx takes E4M3 weights; got {qdata.dtype}")
        n, k = qdata.shape
        q, s = pad_rows(qdata, scale, N_ALIGN)  # torch._scaled_mm: both dimensions of mat2 divisible by 16
        return PreparedWeight(self.name, recipe, n, k, {"qdata": q.contiguous(), "scale": to_128x4(s)})

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        return cublas_mx_linear(x, weight, bias)

    def export_mx(self, weight: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        q, n, k = weight.tensors["qdata"], weight.out_features, weight.in_features
        return q[:n], from_128x4(weight.tensors["scale"], q.shape[0], k // BLOCK_SIZE)[:n]

    def check_grouped(self, device: DeviceInfo) -> Availability:
        if not hasattr(torch, "_scaled_grouped_mm"):
            return Availability(False, f"torch {torch.__version__} has no _scaled_grouped_mm")
        if device.capability is None or device.capability < (10, 0):
            return Availability(False, f"PyTorch's MXFP8 grouped GEMM runs on SM100 and up; {device} is below that")
        return probe_cublas_mx_grouped(device.index)

    def prepare_grouped(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedGroupedWeight:
        """The E4M3 experts as they are, each expert's scales swizzled 128x4 (``[E, round_up(N, 128) *
        round_up(K/32, 4)]``); refused where K is not a multiple of 128."""
        e, n, k = qdata.shape
        if qdata.dtype != torch.float8_e4m3fn:
            raise ValueError(f"cublas_mx takes E4M3 weights; got {qdata.dtype}")
        if k % 128:
            raise UnsupportedWeightError(f"PyTorch's MXFP8 grouped GEMM reads K in multiples of 128; K = {k}")
        scale = e8m0_bytes(scale)
        scales = torch.stack([to_128x4(scale[i]) for i in range(e)])
        return PreparedGroupedWeight(
            self.name, recipe, n, k, {"qdata": qdata.contiguous(), "scale": scales}, {}, experts=e
        )

    def run_grouped(self, x, weight, offsets, tactic=None) -> torch.Tensor:
        return cublas_mx_grouped(x, weight, offsets)

    def export_grouped_mx(self, weight: PreparedGroupedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = weight.tensors["qdata"], weight.tensors["scale"]
        n, k = weight.out_features, weight.in_features
        return q, torch.stack([from_128x4(s[i], n, k // BLOCK_SIZE) for i in range(weight.experts)])
