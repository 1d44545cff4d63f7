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

__all__ = ["HybridSM90Backend", "crossover_for", "reencode_max_error"]


def crossover_for(n: int, k: int) -> int:
    """The M from which quantize + cuBLASLt beats the Triton kernel for an [n, k] weight.

    Measured on the H200 (bench/NOTES.md, bench/crossover.py): cuBLASLt already wins at M=16 on weights of
    117M and 470M elements, from M=48 on 16.7M-67M-element weights, and from M=96 on the K=14336 down projection.
    """
    if n * k >= 96 * 2**20:
        return 1
    return 96 if k >= 12288 else 48


# Above this M the Triton path is far from competitive (bench/results/crossover-h200.json): one config is enough.
_TRITON_VARIANTS_MAX_M = 512


def reencode_max_error() -> float:
    return float(os.environ.get("MXGEMM_REENCODE_MAX_ERROR", "1e-5"))


class HybridSM90Backend(Backend):
    name = "hybrid_sm90"
    recipes = ("hybrid-block128",)
    tunable = True
    summary = "one 128x128-block FP8 weight: Triton bf16 x FP8 kernel below the crossover M, cuBLASLt FP8 above"

    def check_device(self, device: DeviceInfo) -> Availability:
        answer = blockwise_device_check(device)
        if not answer:
            return answer
        return Availability(True, "Triton below a measured crossover M, cuBLASLt blockwise FP8 above; one weight")

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
        info["crossover"] = crossover_for(*qdata.shape)
        return PreparedWeight(self.name, recipe, *qdata.shape, tensors, info)

    def tactics(self, m: int, weight: PreparedWeight) -> list[dict]:
        """The crossover's path first (the default), then the other path; below the large-M regime the Triton
        path also offers kernel configs around its measured default (tile N, split-K, pipeline depth)."""
        from ..kernels.w8a16 import default_config

        n, k = weight.out_features, weight.in_features
        base = default_config(m, n, k, block_scaled=True)
        triton = [{"path": "triton", "config": base}]
        if m <= _TRITON_VARIANTS_MAX_M:
            split = base["SPLIT_K"]
            variants = [{"BN": 32}, {"BN": 128}, {"SPLIT_K": split * 2}, {"SPLIT_K": max(split // 2, 1)}]
            variants.append({"num_stages": 4})
            for v in variants:
                cfg = {**base, **v}
                if k >= cfg["SPLIT_K"] * cfg["BK"] and all(t["config"] != cfg for t in triton):
                    triton.append({"path": "triton", "config": cfg})
        cublas = [{"path": "cublas"}]
        return cublas + triton if m >= weight.info["crossover"] else triton + cublas

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        m = x.shape[0]
        path = tactic["path"] if tactic else ("cublas" if m >= weight.info["crossover"] else "triton")
        if path == "cublas":
            return cublas_block_linear(x, weight, bias)
        from ..kernels.w8a16 import default_config, w8a16_linear

        n, k = weight.out_features, weight.in_features
        q = weight.tensors["qdata"][:n].view(torch.uint8)
        cfg = (tactic or {}).get("config") or default_config(m, n, k, block_scaled=True)
        return w8a16_linear(x, q, weight.tensors["block_scale"], bias, block_scaled=True, config=cfg)
