"""``triton``: exact ``w8a16`` Triton kernel reading MX weights (fp8 bytes + E8M0 scales) directly; at large M (bf16
activations) the weight is dequantized chunk by chunk into a transient bf16 buffer for cuBLAS instead (same numerics:
``kernels/dequant.py``)."""

from __future__ import annotations

import importlib.util
import os

import torch

from ..device import DeviceInfo
from ..format import BLOCK_SIZE, E8M0_NAN
from .base import Availability, Backend, PreparedWeight

__all__ = ["TritonBackend", "kernel_scales"]

_MIN_CAPABILITY = (8, 0)  # bf16 and tf32 tensor-core dots
# From this M (bf16 activations) the default is dequantize + cuBLAS: at M=256 on the llama3-8b projections one
# dequantizing pass plus the bf16 GEMM costs 0.55-0.72x the kernel's time (on the H200; at M=128 it wins
# on qkv and o only); a tactic from M=64.
DEQUANT_MIN_M = 256
_DEQUANT_TACTIC_MIN_M = 64


def kernel_scales(qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The scales the kernel reads: 255 (NaN) wherever a 32-block holds a NaN element, and 127 instead of 0 on
    all-zero blocks. Neither changes an output: a NaN weight already makes its whole output column NaN, and a zero
    block is zero under any scale. It lets kernels decode without per-element NaN tests, and more often use the
    plain-scale fast path."""
    n, k = qdata.shape
    blocks = qdata.float().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    scale = torch.where(torch.isnan(blocks).any(dim=-1), E8M0_NAN, scale)
    scale = torch.where((scale == 0) & (blocks == 0).all(dim=-1), 127, scale)
    return scale.to(torch.uint8).contiguous()


class TritonBackend(Backend):
    name = "triton"
    recipes = ("w8a16",)
    tunable = True
    summary = (
        "exact w8a16: a Triton kernel reading MX weights directly; from M = 256 the weight dequantized in chunks for "
        "cuBLAS bf16; any CUDA GPU of SM80+"
    )

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
        s = kernel_scales(qdata, scale)
        plain = bool(((s >= 1) & (s <= 254)).all())  # no 2^-127, no NaN: the kernel's cheaper scale decode
        packed = plain and qdata.dtype == torch.float8_e4m3fn and int(s.max()) <= 134  # the packed decoder's range
        info = {"plain_scales": plain, "packed_decode": packed}
        return PreparedWeight(self.name, recipe, n, k, {"qdata": qdata.contiguous(), "scale": s}, info)

    def tactics(self, m: int, weight: PreparedWeight) -> list[dict]:
        """Kernel configs around the measured default (tile N, tile K, split-K, pipeline depth, decoder) and, from
        M = 64, dequantize + cuBLAS (``{"path": "dequant"}``, first from ``DEQUANT_MIN_M``). Same numerics."""
        from ..kernels.w8a16 import default_config

        n, k = weight.out_features, weight.in_features
        base = default_config(m, n, k, packed_decode=weight.info["packed_decode"])
        out = [base]
        variants = [{"BN": bn} for bn in (32, 64, 128)] + [{"BK": bk} for bk in (64, 128, 256)]
        variants += [{"SPLIT_K": s} for s in (1, 2, 4, 8)] + [{"num_stages": 4}]
        if weight.info["packed_decode"]:
            variants.append({"PACKED": not base["PACKED"]})
        for v in variants:
            cfg = {**base, **v}
            if cfg not in out and k >= cfg["SPLIT_K"] * cfg["BK"]:
                out.append(cfg)
        if m >= DEQUANT_MIN_M:
            return [{"path": "dequant"}, *out]
        return [*out, {"path": "dequant"}] if m >= _DEQUANT_TACTIC_MIN_M else out

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        from ..kernels.w8a16 import default_config, w8a16_linear

        q = weight.tensors["qdata"]
        m, (n, k) = x.shape[0], q.shape
        dequant = tactic.get("path") == "dequant" if tactic else m >= DEQUANT_MIN_M
        if dequant and x.dtype == torch.bfloat16:
            from ..kernels.dequant import dequant_linear

            e5m2, plain = q.dtype == torch.float8_e5m2, weight.info["plain_scales"]
            return dequant_linear(x, q.view(torch.uint8), weight.tensors["scale"], bias, e5m2=e5m2, plain_scales=plain)
        if tactic and "path" in tactic:
            tactic = None  # fp16 activations: the kernel's default config (exact for them; same recipe)
        return w8a16_linear(
            x,
            q.view(torch.uint8),
            weight.tensors["scale"],
            bias,
            e5m2=q.dtype == torch.float8_e5m2,
            plain_scales=weight.info["plain_scales"],
            config=tactic or default_config(m, n, k, packed_decode=weight.info["packed_decode"]),
        )
