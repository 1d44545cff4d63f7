"""``hybrid_sm90``: one stored weight for both regimes on Hopper.

The weight is stored once, re-encoded to FP8 with power-of-two 128x128 block scales (as ``cublas_block`` stores it).
Below a crossover M (memory-bound decode) our Triton kernel reads that weight and multiplies it with the bf16/fp16
activations as given; at and above it (compute-bound prefill) activations are quantized per 1x128 and cuBLASLt runs
the blockwise FP8 GEMM. Recipe ``hybrid-block128``: the first regime is exact with respect to the re-encoded weight,
which itself differs from the MX weight only as its exactness report says; a weight whose re-encoding error exceeds
``MXGEMM_REENCODE_MAX_ERROR`` (relative, default 1e-5) is refused, and ``auto`` then gives that layer to the next
backend (the exact ``triton`` one).
"""

from __future__ import annotations

import os

import torch

from ..device import DeviceInfo
from .base import Availability, Backend, PreparedWeight, UnsupportedWeightError
from .cublas_block import blockwise_device_check, cublas_block_linear, prepare_block128

__all__ = ["DEFAULT_CROSSOVER", "HybridSM90Backend", "reencode_max_error"]

# Measured on the H200 (bench/NOTES.md): from this M on, quantize + cuBLASLt beats the Triton kernel.
DEFAULT_CROSSOVER = 64


def reencode_max_error() -> float:
    return float(os.environ.get("MXGEMM_REENCODE_MAX_ERROR", "1e-5"))


def small_m_config(m: int, n: int, multiprocessors: int = 132) -> dict[str, int]:
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = -(-n // 64) * -(-m // bm)
    split = 1
    while tiles * split < 2 * multiprocessors and split < 8:
        split *= 2
    return dict(BN=64, BM=bm, BK=128, SPLIT_K=split, num_warps=4, num_stages=3)


class HybridSM90Backend(Backend):
    name = "hybrid_sm90"
    recipes = ("hybrid-block128",)
    summary = "one 128x128-block FP8 weight: Triton bf16 x FP8 kernel below the crossover M, cuBLASLt FP8 above"

    def check_device(self, device: DeviceInfo) -> Availability:
        answer = blockwise_device_check(device)
        if not answer:
            return answer
        return Availability(True, f"Triton for M < {DEFAULT_CROSSOVER}, cuBLASLt blockwise FP8 above, one weight")

    def prepare(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedWeight:
        if qdata.dtype != torch.float8_e4m3fn:
            raise UnsupportedWeightError(f"re-encodes E4M3 weights only; got {qdata.dtype}")
        tensors, info = prepare_block128(qdata, scale)
        report, limit = info["reencode"], reencode_max_error()
        if report.rel_error > limit:
            raise UnsupportedWeightError(
                f"re-encoding to 128x128 blocks would change this weight by {report.rel_error:.3g} (relative), above "
                f"MXGEMM_REENCODE_MAX_ERROR={limit:g} ({report})"
            )
        info["crossover"] = DEFAULT_CROSSOVER
        return PreparedWeight(self.name, recipe, *qdata.shape, tensors, info)

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        m = x.shape[0]
        if m >= weight.info["crossover"]:
            return cublas_block_linear(x, weight, bias)
        from ..kernels.w8a16 import w8a16_linear

        n = weight.out_features
        q = weight.tensors["qdata"][:n].view(torch.uint8)
        cfg = small_m_config(m, n)
        return w8a16_linear(x, q, weight.tensors["block_scale"], bias, block_scaled=True, config=cfg)
