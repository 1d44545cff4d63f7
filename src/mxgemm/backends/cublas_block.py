"""``cublas_block``: the ``w8a8-block`` recipe on Hopper FP8 tensor cores through cuBLASLt (``torch._scaled_mm``).

Weights are re-encoded once from MX (1x32, E8M0) to FP8 with one power-of-two fp32 scale per 128x128 block
(:func:`mxgemm.block128.prepare_block128`; the exactness report stays on the prepared weight). Activations are
quantized per 1x128 by our own Triton kernel, inside the call. cuBLASLt's constraints are met by padding, never by
refusing a valid input: M to a multiple of 4, N to a multiple of 16, K to a multiple of 512 (zeros).
"""

from __future__ import annotations

import torch

from ..block128 import BLOCK128_ROWS, block128_to_mx, prepare_block128
from ..device import DeviceInfo
from ..kernels.cublaslt import blockwise_device_check, blockwise_linear
from ..recipes import Recipe
from .base import Availability, Backend, PreparedWeight
from .capabilities import JoinsRows

__all__ = ["CublasBlockBackend"]


class CublasBlockBackend(Backend, JoinsRows):
    name = "cublas_block"
    recipes = (Recipe.W8A8_BLOCK,)
    summary = "FP8 tensor cores via cuBLASLt blockwise scaling; weight re-encoded to 128x128 blocks (SM90)"

    def check_device(self, device: DeviceInfo) -> Availability:
        return blockwise_device_check(device)

    def prepare(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedWeight:
        if qdata.dtype != torch.float8_e4m3fn:
            raise ValueError(f"cublas_block re-encodes E4M3 weights; got {qdata.dtype}")
        tensors, info = prepare_block128(qdata, scale)
        return PreparedWeight(self.name, recipe, *qdata.shape, tensors, info)

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        t = weight.tensors
        return blockwise_linear(x, t["qdata"], t["block_scale"], weight.out_features, bias)

    def row_layout(self, weight: PreparedWeight) -> dict[str, int]:
        return BLOCK128_ROWS

    def export_mx(self, weight: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        t = weight.tensors
        return block128_to_mx(t["qdata"], t["block_scale"], weight.out_features, weight.in_features)
