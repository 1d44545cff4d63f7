"""``hybrid_sm90``: one stored weight for both regimes on Hopper.

The weight is stored once, re-encoded to FP8 with power-of-two 128x128 block scales (as ``cublas_block`` stores it).
Below a crossover M (memory-bound decode) our kernels read that weight and multiply it with the bf16/fp16 activations as
given: up to M = 16 a hand-written CUDA kernel (``kernels/csrc/small_m.cu``, built with nvcc on first use; without nvcc
the Triton kernel takes its place), above that a Triton kernel; at and above the crossover activations are quantized per
1x128 and a blockwise FP8 GEMM runs: up to M = 64 our TMA/wgmma kernel (``kernels/csrc/fp8_gemm.cu``, K split over a
cluster; where it is built; up to M = 128 where its CTAs fit on the SMs in one wave), above that cuBLASLt (the tuner
picks either per shape up to M = 256, same numerics). Where our FP8 kernel is built, the crossover of large weights is
M = 1: it streams them faster than the exact kernels even at decode (``crossover_for``). Recipe ``hybrid-block128``:
the first regime is exact with respect to the re-encoded weight (the CUDA kernel for ``|x| < 2^64``), which itself
differs from the MX weight only as its exactness report says; a weight whose re-encoding error exceeds
``MXGEMM_REENCODE_MAX_ERROR`` (relative, default 1e-5) is refused, and ``auto`` then gives that layer to the next
backend (the exact ``triton`` one).
"""

from __future__ import annotations

import torch

from .. import settings
from ..block128 import block128_to_mx
from ..device import DeviceInfo
from ..kernels import fp8_gemm
from ..kernels.small_m import MAX_M, accepts, small_m_status
from ..kernels.small_m import default_config as small_m_default
from ..kernels.small_m import linear_plan as small_m_plan
from ..kernels.small_m import valid_config as valid_small_m
from .base import Availability, Backend, PreparedWeight, UnsupportedWeightError, finish_output
from .cublas_block import blockwise_device_check, cublas_block_linear, prepare_block128

__all__ = ["HybridSM90Backend", "crossover_for", "fused_for", "reencode_max_error"]


def fused_for(m: int, n: int, k: int) -> bool | str:
    """How the FP8 plan launches for M rows of an [n, k] weight (``fp8_gemm.linear_plan``'s ``fused``): the fused
    kernel outside graph capture ("auto") up to M = 32 on weights of at most 16Mi elements, else quantizer + GEMM.

    Measured on the H200 (bench/explore/results/fused-fp8-h200.json): the fused kernel saves 3-5 µs of an eager call's
    host time, and there an eager call is bound by host time (about 16-20 µs) while the fused kernel's device time is
    9-15 µs (4096 x 4096, 3584 x 3584 and 4608 x 3584 at M = 1-32). It quantizes on its consumers' path, so its
    device time grows with the tokens: on larger weights (6144 x 4096: 22 µs at M = 17-32) an eager call would wait
    for the GPU instead, and a fused tokens-as-M kernel for M = 33-64 took 2-5x the two kernels' device time."""
    return "auto" if m <= 32 and n * k <= 16 * 2**20 else False


def crossover_for(n: int, k: int, small_m: bool = True, fp8: bool = False) -> int:
    """The M from which quantize + blockwise FP8 beats our exact kernels for an [n, k] weight (``small_m``: whether
    the CUDA small-M kernel is built here; ``fp8``: whether our FP8 kernel is).

    Measured on the H200. Our FP8 kernel, with 8 or 16 tokens per CTA, streams large weights faster than the exact
    kernels from M = 1: it wins from M = 1 on every weight of 96Mi elements or more (117M-470M), from M = 16 on the
    51M-84M ones (at M = 8 2-9% slower on four of five). On the 17M and 25M ones it takes over from M = 17, where the
    CUDA kernel stops: at M = 16-32 the two are within 9% of each other under graph replay
    (bench/results/crossover-fp8-h200.json), and an eager call of the Triton kernel between them would pay Triton's
    Python launcher (40-80 µs on the H200). Without the FP8 kernel: against the Triton kernel cuBLASLt wins at M = 16
    on weights of 117M and 470M elements, from M = 48 on 16.7M-67M-element weights, and from M = 96 on the K = 14336
    down projection; the CUDA kernel beats cuBLASLt up to M = 8 on every measured weight and at M = 16 on all but the
    8B gate_up (3% slower there), so with it no crossover falls below M = 17.
    """
    if fp8:
        return 1 if n * k >= 96 * 2**20 else 16 if n * k >= 32 * 2**20 else MAX_M + 1
    rule = 1 if n * k >= 96 * 2**20 else 96 if k >= 12288 else 48
    return max(rule, MAX_M + 1) if small_m else rule


# Above this M the Triton path is far from competitive (bench/results/crossover-h200.json): one config is enough.
_TRITON_VARIANTS_MAX_M = 512
# Our FP8 kernel is a tactic of the quantized regime up to this M, its default where fp8_gemm.default_beats_cublas.
_FP8_TACTICS_MAX_M = 256
_QUANTIZED_PATHS = ("cublas", "fp8")


reencode_max_error = settings.reencode_max_error


class HybridSM90Backend(Backend):
    name = "hybrid_sm90"
    recipes = ("hybrid-block128",)
    tunable = True
    summary = (
        "one 128x128-block FP8 weight: a CUDA mma kernel for small M and a Triton kernel below the crossover M "
        "(activations as given), our FP8 wgmma kernel or cuBLASLt above"
    )

    def check_device(self, device: DeviceInfo) -> Availability:
        answer = blockwise_device_check(device)
        if not answer:
            return answer
        small, fp8 = small_m_status(device.capability), fp8_gemm.fp8_gemm_status(device.capability)
        missing = "; ".join(status.reason for status in (small, fp8) if not status)
        return Availability(
            True,
            f"{'CUDA kernel up to M = 16, ' if small else ''}Triton below a measured crossover M, "
            f"{'our FP8 kernel up to M = 64 (128 while its CTAs fit one wave) and ' if fp8 else ''}cuBLASLt blockwise "
            f"FP8 above; one weight"
            f"{f' ({missing})' if missing else ''}",
        )

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
        capability = torch.cuda.get_device_capability(qdata.device) if qdata.is_cuda else None
        info["small_m"] = bool(small_m_status(capability))
        if fp8_gemm.fp8_gemm_status(capability):
            info["fp8_sms"] = torch.cuda.get_device_properties(qdata.device).multi_processor_count
        info["crossover"] = crossover_for(*qdata.shape, small_m=info["small_m"], fp8="fp8_sms" in info)
        return PreparedWeight(self.name, recipe, *qdata.shape, tensors, info)

    @staticmethod
    def _default_path(m: int, weight: PreparedWeight) -> str:
        if m >= weight.info["crossover"]:
            sms, np_ = weight.info.get("fp8_sms"), weight.tensors["qdata"].shape[0]
            return "fp8" if sms and fp8_gemm.default_beats_cublas(m, np_, sms) else "cublas"
        return "cuda" if m <= MAX_M and weight.info.get("small_m") else "triton"

    @staticmethod
    def _fp8_default(m: int, weight: PreparedWeight) -> dict:
        np_, kp = weight.tensors["qdata"].shape
        return fp8_gemm.default_config(m, np_, kp, weight.info["fp8_sms"])

    def tactics(self, m: int, weight: PreparedWeight) -> list[dict]:
        """Paths and configs that compute this M's regime of the recipe, so that no tactic changes the numerics:
        from the crossover M cuBLASLt and (up to M = 256, where built) our FP8 kernel's configs, the default first;
        below it the default first (the CUDA kernel up to M = 16 where it is built, else Triton), then the CUDA
        kernel's row tiles, K splits and ring depths and Triton configs around its measured default (tile N,
        split-K, pipeline depth)."""
        if m >= weight.info["crossover"]:
            if m > _FP8_TACTICS_MAX_M or "fp8_sms" not in weight.info:
                return [{"path": "cublas"}]
            default = self._fp8_default(m, weight)
            kp = weight.tensors["qdata"].shape[1]
            configs = [default] + [c for c in fp8_gemm.tactic_configs(m, kp) if c != default]
            fp8 = [{"path": "fp8", "config": c} for c in configs]
            return [*fp8, {"path": "cublas"}] if self._default_path(m, weight) == "fp8" else [{"path": "cublas"}, *fp8]
        from ..kernels.w8a16 import default_config

        n, k = weight.out_features, weight.in_features
        base = default_config(m, n, k, block_scaled=True)
        paths = {"triton": [{"path": "triton", "config": base}], "cuda": []}
        if m <= _TRITON_VARIANTS_MAX_M:
            split = base["SPLIT_K"]
            variants = [{"BN": 32}, {"BN": 128}, {"SPLIT_K": split * 2}, {"SPLIT_K": max(split // 2, 1)}]
            variants.append({"num_stages": 4})
            for v in variants:
                cfg = {**base, **v}
                if k >= cfg["SPLIT_K"] * cfg["BK"] and all(t["config"] != cfg for t in paths["triton"]):
                    paths["triton"].append({"path": "triton", "config": cfg})
        if m <= MAX_M and weight.info.get("small_m"):
            np_, kp = weight.tensors["qdata"].shape
            configs = [small_m_default(np_, kp)] + [
                {"RT": r, "SPLITS": sp, "ST": st} for r in (1, 2) for sp in (1, 2, 4, 8) for st in (2, 3)
            ]
            for cfg in configs:
                if valid_small_m(cfg, np_, kp) and {"path": "cuda", "config": cfg} not in paths["cuda"]:
                    paths["cuda"].append({"path": "cuda", "config": cfg})
        first = self._default_path(m, weight)
        return paths[first] + [t for name, ts in paths.items() if name != first for t in ts]

    def _choose(self, m: int, weight: PreparedWeight, tactic) -> tuple[str, dict | None]:
        """The kernel path and config for M rows: the tactic's where it computes this M's regime, else the
        default's; configs an older tuning file holds that the current kernels reject give way to their defaults."""
        default = self._default_path(m, weight)
        if tactic and (tactic["path"] in _QUANTIZED_PATHS) != (default in _QUANTIZED_PATHS):
            tactic = None  # a cached tactic of the other regime (its bucket spans the crossover) would change numerics
        path = tactic["path"] if tactic else default
        config = (tactic or {}).get("config")
        if path == "fp8" and "fp8_sms" not in weight.info:
            path = "cublas"  # a tuning file's FP8 tactic where the kernel is not built: the same numerics
        qd = weight.tensors["qdata"]
        if path == "fp8" and (config is None or not fp8_gemm.valid_config(config, qd.shape[1])):
            config = self._fp8_default(m, weight)
        if path == "cuda" and (not weight.info.get("small_m") or m > MAX_M):
            path, config = "triton", None
        if path == "cuda" and config is not None and not valid_small_m(config, *qd.shape):
            config = None
        return path, config

    def plan(self, weight: PreparedWeight, m: int, x_dtype: torch.dtype, tactic=None):
        path, config = self._choose(m, weight, tactic)
        n, k = weight.out_features, weight.in_features
        qd, bs = weight.tensors["qdata"], weight.tensors["block_scale"]
        if path == "cublas":
            quantize = fp8_gemm.quantize_1x128 if "fp8_sms" in weight.info else None  # CUDA where built, else Triton
            return lambda x, bias: cublas_block_linear(x, weight, bias, quantize=quantize)
        if path == "fp8":
            fp8 = fp8_gemm.linear_plan(qd, bs, n, k, m, config, fused_for(m, n, k))
            return _bf16_epilogue(lambda x, bias: fp8(x if x.stride(1) == 1 else x.contiguous(), bias), n)
        from ..kernels.w8a16 import default_config, w8a16_linear

        q8 = qd[:n].view(torch.uint8)
        cfg = config if path == "triton" and config else default_config(m, n, k, block_scaled=True)
        triton = lambda x, bias: w8a16_linear(x, q8, bs, bias, block_scaled=True, config=cfg)  # noqa: E731
        if path == "triton" or x_dtype != torch.bfloat16:
            return triton
        small = _bf16_epilogue(small_m_plan(qd, bs, n, k, m, config), n)
        # strided or misaligned activations: a copy into a fresh (aligned) buffer, so the same kernel runs
        return lambda x, bias: small(x if accepts(x) else x.clone(memory_format=torch.contiguous_format), bias)

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        return self.plan(weight, x.shape[0], x.dtype, tactic)(x, bias)

    def export_mx(self, weight: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        t = weight.tensors
        return block128_to_mx(t["qdata"], t["block_scale"], weight.out_features, weight.in_features)


def _bf16_epilogue(launch, n: int):
    """``(x, bias) -> y`` in ``x.dtype`` around a launch that writes bf16 and adds a contiguous bf16 bias in its
    epilogue: any other bias is added after it, and fp16 callers get the output converted."""

    def call(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return finish_output(launch(x, None), x, bias, n)
        y = launch(x, bias)
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)

    return call
