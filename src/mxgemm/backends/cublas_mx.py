"""``cublas_mx``: the ``w8a8-mx`` recipe through ``torch._scaled_mm`` with float8_e8m0fnu scales in 128x4 layout.

cuBLAS offers no capability query for block-scaled MX GEMMs, so availability is probed once per device with a tiny
problem (compared with its emulated twin) and cached; the error text is the reason (on an H200 cuBLAS answers
CUBLAS_STATUS_NOT_SUPPORTED). Not run on Blackwell by this project yet.
"""

from __future__ import annotations

import functools

import torch

from ..availability import probe_against_twin, probe_operands, probe_preconditions
from ..device import DeviceInfo
from ..format import BLOCK_SIZE
from ..layouts import finish_output, from_128x4, pad_rows, to_128x4
from ..recipes import MX_ACT_SCALE_MODE, Recipe
from .base import Availability, Backend, PreparedWeight

__all__ = ["CublasMXBackend", "probe_cublas_mx"]

N_ALIGN = 16


def cublas_mx_linear(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    from ..kernels.mx_quant import mx_quantize

    xq, xs = mx_quantize(x, scale_mode=MX_ACT_SCALE_MODE, layout="128x4")
    t = weight.tensors
    e8m0 = torch.float8_e8m0fnu
    y = torch._scaled_mm(xq, t["qdata"].t(), xs.view(e8m0), t["scale"].view(e8m0), out_dtype=torch.bfloat16)
    return finish_output(y, x, bias, weight.out_features)


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


class CublasMXBackend(Backend):
    name = "cublas_mx"
    recipes = (Recipe.W8A8_MX,)
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
