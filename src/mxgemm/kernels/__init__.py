"""Hand-written kernels. Each module imports its compiler (Triton) at import time, so import them lazily.

The helpers here serve the bindings of the CUDA kernels (``small_m``, ``fp8_gemm``)."""

from __future__ import annotations

import torch


def raw_stream(device_index: int) -> int:
    """The current CUDA stream of a device as an integer handle (what Triton's launcher reads too)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def check_bf16_bias(bias: torch.Tensor | None, n: int) -> None:
    """The kernels add a bias in their epilogue only as a contiguous bf16 ``[n]`` tensor."""
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous bf16 [{n}] tensor, got {bias.dtype} {tuple(bias.shape)}")
