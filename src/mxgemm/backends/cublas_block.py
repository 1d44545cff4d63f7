"""``cublas_block``: the ``w8a8-block`` recipe on Hopper FP8 tensor cores through cuBLASLt (``torch._scaled_mm``).

Weights are re-encoded once from MX (1x32, E8M0) to FP8 with one power-of-two fp32 scale per 128x128 block
(:func:`mxgemm.block128.reencode_block128`; the exactness report stays on the prepared weight). Activations are
quantized per 1x128 by our own Triton kernel, inside the call. cuBLASLt's constraints are met by padding, never by
refusing a valid input: M to a multiple of 4, N to a multiple of 16, K to a multiple of 512 (zeros).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..block128 import CUBLASLT_K_ALIGN, block128_to_mx, reencode_block128
from ..device import DeviceInfo
from ..layouts import round_up
from .base import (
    Availability,
    Backend,
    PreparedWeight,
    finish_output,
    probe_against_twin,
    probe_operands,
    probe_preconditions,
)

__all__ = ["CublasBlockBackend", "cublas_block_linear", "prepare_block128", "probe_cublas_blockwise"]

N_ALIGN = 16


def prepare_block128(qdata: torch.Tensor, scale: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """Re-encode an MX weight for cuBLASLt: fp8 ``[Np, Kp]`` (zero padded), fp32 block scales ``[Np/128, Kp/128]``."""
    n, k = qdata.shape
    np_, kp = round_up(n, N_ALIGN), round_up(k, CUBLASLT_K_ALIGN)
    q = torch.zeros((np_, kp), dtype=torch.uint8, device=qdata.device).view(torch.float8_e4m3fn)
    block = reencode_block128(qdata, scale, out=q)  # written into the padded buffer: no second copy
    nb = -(-np_ // 128)
    s = F.pad(block.scale, (0, kp // 128 - block.scale.shape[1], 0, nb - block.scale.shape[0]), value=1.0)
    return {"qdata": q, "block_scale": s.contiguous()}, {"reencode": block.report}


def cublas_block_linear(
    x: torch.Tensor,
    weight: PreparedWeight,
    bias: torch.Tensor | None,
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Quantize ``x`` per 1x128 (with ``quantize``, bit-exact to the Triton quantizer it defaults to) and run
    cuBLASLt's blockwise FP8 GEMM; [M, N] in ``x.dtype``."""
    if quantize is None:
        from ..kernels.act_quant import quantize_1x128_padded as quantize

    m, n = x.shape[0], weight.out_features
    xq, xs = quantize(x if x.stride(1) == 1 else x.contiguous())
    q, s = weight.tensors["qdata"], weight.tensors["block_scale"]
    # cuBLASLt writes bf16 for block scaling; fp16 callers get it converted
    y = torch._scaled_mm(xq, q.t(), xs, s.t(), out_dtype=torch.bfloat16)[:m]
    return finish_output(y, x, bias, n)


@functools.cache
def probe_cublas_blockwise(index: int) -> Availability:
    """Run one small blockwise GEMM on CUDA device ``index`` and compare it with its emulated twin (cached)."""

    def run():
        from ..block128 import dequantize_1x128, quantize_1x128

        t, x = probe_operands(index, 256, 512, 4)
        tensors, info = prepare_block128(t.qdata, t.scale)
        pw = PreparedWeight("cublas_block", "w8a8-block", 256, 512, tensors, info)
        ref = dequantize_1x128(*quantize_1x128(x)) @ reencode_block128(t.qdata, t.scale).dequantize().T
        return cublas_block_linear(x, pw, None), ref

    return probe_against_twin("cuBLASLt 1x128 x 128x128 blockwise FP8 GEMM", run)


def blockwise_device_check(device: DeviceInfo) -> Availability:
    """The device-level part shared by every backend that runs cuBLASLt's blockwise FP8 GEMM."""
    if device.type != "cuda":
        return Availability(False, f"needs a CUDA GPU; this device is {device.type}")
    if device.capability is None or device.capability[0] != 9:
        return Availability(False, f"cuBLASLt 1x128 x 128x128 blockwise FP8 runs on Hopper (SM90); {device} is not")
    cuda = torch.version.cuda
    if cuda is None or tuple(int(p) for p in cuda.split(".")[:2]) < (12, 9):
        return Availability(False, f"needs a torch built with CUDA >= 12.9 for blockwise scaling, this one has {cuda}")
    missing = probe_preconditions(device, "cuBLASLt")
    return missing if missing is not None else probe_cublas_blockwise(device.index)


class CublasBlockBackend(Backend):
    name = "cublas_block"
    recipes = ("w8a8-block",)
    summary = "FP8 tensor cores via cuBLASLt blockwise scaling; weight re-encoded to 128x128 blocks (SM90)"

    def check_device(self, device: DeviceInfo) -> Availability:
        return blockwise_device_check(device)

    def prepare(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedWeight:
        if qdata.dtype != torch.float8_e4m3fn:
            raise ValueError(f"cublas_block re-encodes E4M3 weights; got {qdata.dtype}")
        tensors, info = prepare_block128(qdata, scale)
        return PreparedWeight(self.name, recipe, *qdata.shape, tensors, info)

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        return cublas_block_linear(x, weight, bias)

    def export_mx(self, weight: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        t = weight.tensors
        return block128_to_mx(t["qdata"], t["block_scale"], weight.out_features, weight.in_features)
