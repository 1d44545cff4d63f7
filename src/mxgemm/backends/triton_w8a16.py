"""``triton``: exact ``w8a16`` Triton kernel reading MX weights (fp8 bytes + E8M0 scales) directly."""

from __future__ import annotations

import importlib.util
import os

import torch

from ..device import DeviceInfo
from ..format import BLOCK_SIZE, E8M0_NAN
from .base import Availability, Backend, PreparedWeight

__all__ = ["TritonBackend", "nan_blocks_to_nan_scale"]

_MIN_CAPABILITY = (8, 0)  # bf16 and tf32 tensor-core dots


def nan_blocks_to_nan_scale(qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Scales with 255 (NaN) wherever a 32-block holds a NaN element.

    Dequantized outputs are unchanged by this: any NaN in a weight row already makes that whole output column NaN.
    It lets kernels decode elements without a per-element NaN test.
    """
    n, k = qdata.shape
    has_nan = torch.isnan(qdata.float()).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE).any(dim=-1)
    return torch.where(has_nan, torch.full_like(scale, E8M0_NAN), scale).contiguous()


class TritonBackend(Backend):
    name = "triton"
    recipes = ("w8a16",)
    summary = "exact w8a16 Triton kernel reading MX weights directly; any CUDA GPU of SM80+"

    def check_device(self, device: DeviceInfo) -> Availability:
        if importlib.util.find_spec("triton") is None:
            return Availability(False, "the 'triton' package is not installed (pip install 'mxgemm[triton]')")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return Availability(True, "Triton interpreter on CPU (TRITON_INTERPRET=1): for tests only, very slow")
        if device.type != "cuda":
            return Availability(False, f"needs a CUDA GPU; this device is {device.type}")
        if device.capability is None or device.capability < _MIN_CAPABILITY:
            return Availability(
                False, f"needs compute capability >= 8.0 (bf16/tf32 tensor cores); {device} is below that"
            )
        return Availability(True, f"Triton kernel on {device}")

    def prepare(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedWeight:
        n, k = qdata.shape
        tensors = {"qdata": qdata.contiguous(), "scale": nan_blocks_to_nan_scale(qdata, scale)}
        return PreparedWeight(self.name, recipe, n, k, tensors)

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        from ..kernels.w8a16 import w8a16_linear

        q = weight.tensors["qdata"]
        return w8a16_linear(x, q.view(torch.uint8), weight.tensors["scale"], bias, e5m2=q.dtype == torch.float8_e5m2)
