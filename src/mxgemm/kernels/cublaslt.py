"""cuBLASLt's blockwise FP8 GEMM (``torch._scaled_mm`` with 1x128 activation and 128x128 weight scales, Hopper): the
call, and the probe that answers whether it runs here. cuBLASLt's constraints are met by the operands' padding
(:func:`mxgemm.block128.prepare_block128`, :func:`mxgemm.block128.padded_1x128_shape`), never by refusing an input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..availability import Availability, probe_against_twin, probe_operands, probe_preconditions
from ..device import DeviceInfo
from ..layouts import finish_output

__all__ = ["blockwise_device_check", "blockwise_linear", "probe_blockwise"]


def blockwise_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``x`` [M, K] quantized per 1x128 (with ``quantize``, bit-exact to the Triton quantizer it defaults to) times
    a padded 128x128-block weight (``qdata`` E4M3 [Np, Kp], ``block_scale`` fp32 [Np/128, Kp/128]) -> [M, n] in
    ``x.dtype`` (+ ``bias``)."""
    if quantize is None:
        from .act_quant import quantize_1x128_padded as quantize

    m = x.shape[0]
    xq, xs = quantize(x if x.stride(1) == 1 else x.contiguous())
    # cuBLASLt writes bf16 for block scaling; fp16 callers get it converted
    y = torch._scaled_mm(xq, qdata.t(), xs, block_scale.t(), out_dtype=torch.bfloat16)[:m]
    return finish_output(y, x, bias, n)


@functools.cache
def probe_blockwise(index: int) -> Availability:
    """Run one small blockwise GEMM on CUDA device ``index`` and compare it with its emulated twin (cached)."""

    def run():
        from ..block128 import dequantize_1x128, prepare_block128, quantize_1x128, reencode_block128

        t, x = probe_operands(index, 256, 512, 4)
        tensors, _ = prepare_block128(t.qdata, t.scale)
        ref = dequantize_1x128(*quantize_1x128(x)) @ reencode_block128(t.qdata, t.scale).dequantize().T
        return blockwise_linear(x, tensors["qdata"], tensors["block_scale"], 256, None), ref

    return probe_against_twin("cuBLASLt 1x128 x 128x128 blockwise FP8 GEMM", run)


def blockwise_device_check(device: DeviceInfo) -> Availability:
    """Whether cuBLASLt's blockwise FP8 GEMM runs on ``device`` (Hopper, a torch built with CUDA >= 12.9, a probe)."""
    if device.type != "cuda":
        return Availability(False, f"needs a CUDA GPU; this device is {device.type}")
    if device.capability is None or device.capability[0] != 9:
        return Availability(False, f"cuBLASLt 1x128 x 128x128 blockwise FP8 runs on Hopper (SM90); {device} is not")
    cuda = torch.version.cuda
    if cuda is None or tuple(int(p) for p in cuda.split(".")[:2]) < (12, 9):
        return Availability(False, f"needs a torch built with CUDA >= 12.9 for blockwise scaling, this one has {cuda}")
    missing = probe_preconditions(device, "cuBLASLt")
    return missing if missing is not None else probe_blockwise(device.index)
