"""``hybrid_sm90``: one stored weight for both regimes on Hopper.

The weight is stored once, re-encoded to FP8 with power-of-two 128x128 block scales (as ``cublas_block`` stores it).
Below a crossover M (memory-bound decode) our kernels read that weight and multiply it with the bf16/fp16
activations as given: up to M = 16 a hand-written CUDA kernel (``kernels/csrc/small_m.cu``, built with nvcc on first
use; without nvcc the Triton kernel takes its place), above that a Triton kernel; at and above the crossover
activations are quantized per 1x128 and a blockwise FP8 GEMM runs: up to M = 64 our TMA/wgmma kernel
(``kernels/csrc/fp8_gemm.cu``, K split over a cluster; where it is built; up to M = 128 where its CTAs fit on the
SMs in one wave), above that cuBLASLt (the tuner picks either per shape up to M = 256, same numerics). Where our FP8
kernel is built, the crossover of large weights is M = 1: it streams them faster than the exact kernels even at
decode (``recipes.hybrid_crossover``). Recipe ``hybrid-block128``: the first regime is exact with respect to the
re-encoded weight (the CUDA kernel for ``|x| < 2^64``), which itself differs from the MX weight only as its exactness
report says; a weight whose re-encoding error exceeds ``MXGEMM_REENCODE_MAX_ERROR`` (relative, default 1e-5) is
refused, and ``auto`` then gives that layer to the next backend (the exact ``triton`` one).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from .. import thresholds
from ..block128 import BLOCK128_ROWS, block128_to_mx, prepare_block128
from ..device import DeviceInfo
from ..kernels import Launch, cublaslt, fp8_gemm
from ..kernels.cublaslt import blockwise_device_check, blockwise_linear
from ..kernels.fp8_gemm import STAGES, TOKEN_TILES, Fp8Config, SwapAB, TokensAsM
from ..kernels.small_m import MAX_M, SmallMConfig, small_m_status
from ..kernels.small_m import linear_plan as small_m_plan
from ..recipes import Recipe, StrEnum, hybrid_crossover
from .base import Availability, Backend, PreparedWeight, Tactic, any_rows, check_reencoding, run_time_info
from .capabilities import GatedInput, JoinsRows, SharesQuantizedInput

logger = logging.getLogger("mxgemm")

__all__ = [
    "HybridSM90Backend",
    "Path",
    "fp8_beats_cublas",
    "fp8_configs",
    "fp8_default",
    "small_m_configs",
    "small_m_default",
]


class Path(StrEnum):
    """The kernels that run a call: the exact regime below the crossover M, the quantized one from it."""

    SMALL_M = "small_m"  # the CUDA small-M kernel (kernels/csrc/small_m.cu), activations as given
    TRITON = "triton"  # the Triton w8a16 kernel on the block weight, activations as given
    FP8 = "fp8"  # the 1x128 quantizer + our FP8 wgmma GEMM (kernels/csrc/fp8_gemm.cu)
    CUBLAS = "cublas"  # the 1x128 quantizer + cuBLASLt's blockwise GEMM

    @property
    def quantized(self) -> bool:
        return self in (Path.FP8, Path.CUBLAS)


def _fp8_plan(weight: PreparedWeight, m: int, config: Fp8Config):
    """The FP8 route's plan for M rows: the 1x128 quantizer, then the GEMM (:func:`fp8_gemm.linear_plan`)."""
    t = weight.tensors
    return fp8_gemm.linear_plan(t["qdata"], t["block_scale"], weight.out_features, weight.in_features, m, config)


def _fitting_tile(m: int) -> int:
    """The smallest token tile that holds M tokens (64 above M = 64)."""
    return next(t for t in TOKEN_TILES if t >= min(m, 64))


def fp8_default(m: int, n_padded: int, k_padded: int, sms: int) -> Fp8Config:
    """Above M = 32: tokens as wgmma M (64 weight rows per CTA, 64 tokens up to M = 64 and 128 above), 2 K splits
    while twice the tiles fit on the SMs, 6 ring stages up to four tiles per SM (4 beyond). Up to M = 32, the smallest
    token tile that holds M; where the tiles fit in one CTA per SM, two consumer warpgroups per row tile, 2 K splits
    if the CTAs still fit, 6 stages; otherwise one warpgroup, 2 K splits while the tiles number fewer than two per SM,
    and the deepest ring (6, 4, 2) with which every CTA is resident at once. The best or near-best config of each
    8B / 70B / 7168-hidden projection at M = 16 and 64 on the H200; the tuner picks per shape."""
    even = (k_padded // 128) % 2 == 0
    if m > 32:
        tn = 64 if m <= 64 else 128
        tiles = -(-n_padded // 64) * -(-m // tn)
        return TokensAsM(tn, 64, 2 if 2 * tiles <= sms and even else 1, 6 if tiles <= 4 * sms else 4)
    tn = _fitting_tile(m)
    tiles = -(-n_padded // 64) * -(-m // tn)
    if tiles <= sms:
        return SwapAB(tn, rw=1, kc=2, splits=2 if 2 * tiles <= sms and even else 1, stages=6)
    splits = 2 if tiles < 2 * sms and even else 1
    for st in (6, 4, 2):
        cfg = SwapAB(tn, splits=splits, stages=st)
        if tiles * splits <= sms * cfg.ctas_per_sm(k_padded):
            break
    return cfg


def fp8_beats_cublas(m: int, n_padded: int, sms: int) -> bool:
    """Whether :func:`fp8_default` is the better default than cuBLASLt's blockwise GEMM for M tokens and
    ``n_padded`` weight rows: up to M = 64 always; up to M = 128 while its CTAs (one per 64 weight rows, 128 tokens)
    fit on the SMs in one wave. Measured on the H200 (132 SMs): at M = 72, 96 and 128 faster on the 7 of 12
    projections with N <= 8192 (up to 128 tiles; 11-44% less time), slower on the 5 with N >= 9216 (144+ tiles: a
    second, near-empty wave; 10-45% more); at M = 256 cuBLASLt is faster on 10 of 12 (the tuner takes ours where it
    wins)."""
    return m <= 64 or (m <= 128 and -(-n_padded // 64) <= sms)


def fp8_configs(m: int, k_padded: int) -> list[Fp8Config]:
    """The FP8 configs the tuner tries: the token tile that fits M (and 128 above M = 64), one or two row tiles per
    CTA, one or two consumer warpgroups per row tile (with one row tile), 1, 2 or 4 K splits, each ring depth; above
    M = 32 also tokens as wgmma M with 64 or 128 weight rows per CTA."""
    tiles = (_fitting_tile(m),) if m <= 64 else (64, 128)
    configs: list[Fp8Config] = [
        SwapAB(tn, rw, kc, sp, st)
        for tn in tiles
        for rw, kc in ((1, 1), (2, 1), (1, 2))
        for sp in (1, 2, 4)
        for st in STAGES
    ]
    if m > 32:
        configs += [TokensAsM(tn, wn, sp, st) for tn in tiles for wn in (64, 128) for sp in (1, 2, 4) for st in STAGES]
    return [c for c in configs if c.valid(k_padded)]


def small_m_default(n_padded: int, k_padded: int) -> SmallMConfig:
    """One row tile per CTA, a two-stage ring, and one K split unless the grid has fewer than 384 CTAs and each warp
    more than 8 slices of 512 (then 2 splits in a cluster): the best configs measured on the H200 for most of the 8B,
    70B and 7168-hidden projections at M = 1-16; the tuner picks per shape."""
    ctas, slices = n_padded // 16, k_padded // 512
    return SmallMConfig(1, 2 if ctas < 384 and slices > 8 and slices % 2 == 0 else 1, 2)


def small_m_configs(n_padded: int, k_padded: int) -> list[SmallMConfig]:
    """The small-M configs the tuner tries, the default first: 1 or 2 row tiles, 1-8 K splits, rings of 2 or 3."""
    configs = [small_m_default(n_padded, k_padded)]
    for cfg in (SmallMConfig(r, sp, st) for r in (1, 2) for sp in (1, 2, 4, 8) for st in (2, 3)):
        if cfg.valid(n_padded, k_padded) and cfg not in configs:
            configs.append(cfg)
    return configs


# Above this M the Triton path is far from competitive (bench/results/crossover-h200.json): one config is enough.
_TRITON_VARIANTS_MAX_M = 512
# Our FP8 kernel is a tactic of the quantized regime up to this M, its default where fp8_beats_cublas.
_FP8_TACTICS_MAX_M = 256


class HybridSM90Backend(Backend, JoinsRows, SharesQuantizedInput, GatedInput):
    name = "hybrid_sm90"
    recipes = (Recipe.HYBRID_BLOCK128,)
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
        planned = cublaslt.plan_status(device.index, device.capability)
        missing = "; ".join(status.reason for status in (small, fp8, planned) if not status)
        return Availability(
            True,
            f"{'CUDA kernel up to M = 16, ' if small else ''}Triton below a measured crossover M, "
            f"{'our FP8 kernel up to M = 64 (128 while its CTAs fit one wave) and ' if fp8 else ''}cuBLASLt blockwise "
            f"FP8 above{' (planned calls)' if planned else ''}; one weight"
            f"{f' ({missing})' if missing else ''}",
        )

    def prepare(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedWeight:
        tensors, info = check_reencoding(qdata, lambda: prepare_block128(qdata, scale))
        capability = torch.cuda.get_device_capability(qdata.device) if qdata.is_cuda else None
        info["small_m"] = bool(small_m_status(capability))
        if fp8_gemm.fp8_gemm_status(capability):
            info["fp8_sms"] = torch.cuda.get_device_properties(qdata.device).multi_processor_count
        info["blockwise_plan"] = capability is not None and bool(cublaslt.plan_status(qdata.device.index, capability))
        info["crossover"] = hybrid_crossover(
            *qdata.shape, small_m=info["small_m"], fp8="fp8_sms" in info, table=thresholds.for_device(qdata.device)
        )
        return PreparedWeight(self.name, recipe, *qdata.shape, tensors, info)

    @staticmethod
    def _default(m: int, weight: PreparedWeight) -> Tactic:
        np_, kp = weight.tensors["qdata"].shape
        if m >= weight.info["crossover"]:
            sms = weight.info.get("fp8_sms")
            if sms and fp8_beats_cublas(m, np_, sms):
                return Tactic(Path.FP8, fp8_default(m, np_, kp, sms))
            return Tactic(Path.CUBLAS)
        if m <= MAX_M and weight.info.get("small_m"):
            return Tactic(Path.SMALL_M, small_m_default(np_, kp))
        return Tactic(Path.TRITON, _triton_default(m, weight))

    def tactics(self, m: int, weight: PreparedWeight) -> list[Tactic]:
        """Paths and configs that compute this M's regime of the recipe, so that no tactic changes the numerics, the
        default first: from the crossover M cuBLASLt and (up to M = 256, where built) our FP8 kernel's configs;
        below it the CUDA kernel's configs (up to M = 16, where built) and Triton configs around its measured default
        (tile N, split-K, pipeline depth)."""
        default = self._default(m, weight)
        np_, kp = weight.tensors["qdata"].shape
        if default.path.quantized:
            if m > _FP8_TACTICS_MAX_M or "fp8_sms" not in weight.info:
                return [Tactic(Path.CUBLAS)]
            first = fp8_default(m, np_, kp, weight.info["fp8_sms"])
            fp8 = [Tactic(Path.FP8, c) for c in [first, *(c for c in fp8_configs(m, kp) if c != first)]]
            return [*fp8, Tactic(Path.CUBLAS)] if default.path == Path.FP8 else [Tactic(Path.CUBLAS), *fp8]
        triton = [Tactic(Path.TRITON, _triton_default(m, weight))]
        base = triton[0].config
        if m <= _TRITON_VARIANTS_MAX_M:
            variants = [
                {"bn": 32},
                {"bn": 128},
                {"split_k": base.split_k * 2},
                {"split_k": max(base.split_k // 2, 1)},
                {"stages": 4},
            ]
            for v in variants:
                t = Tactic(Path.TRITON, dataclasses.replace(base, **v))
                if t.config.fills_splits(weight.in_features) and t not in triton:
                    triton.append(t)
        small = []
        if m <= MAX_M and weight.info.get("small_m"):
            small = [Tactic(Path.SMALL_M, c) for c in small_m_configs(np_, kp)]
        return [default, *[t for t in [*small, *triton] if t != default]]

    def choose(self, m: int, weight: PreparedWeight, tactic: Tactic | None = None) -> Tactic:
        """What runs M rows: the given tactic (one of :meth:`tactics` for M's tuning bucket) where it computes this
        M's regime, else the default. A bucket may span the crossover: its tactic then belongs to the other regime,
        and running it would change the numerics."""
        default = self._default(m, weight)
        if tactic is None or tactic.path.quantized != default.path.quantized:
            return default
        if tactic.path == Path.SMALL_M and m > MAX_M:
            return default
        return tactic

    def plan(self, weight: PreparedWeight, m: int, x_dtype: torch.dtype, tactic: Tactic | None = None):
        chosen = self.choose(m, weight, tactic)
        path, config = chosen.path, chosen.config
        n, k = weight.out_features, weight.in_features
        qd, bs = weight.tensors["qdata"], weight.tensors["block_scale"]
        if path == Path.CUBLAS:
            planned = _blockwise_plan(weight, m, x_dtype)
            if planned is not None:
                return planned
            quantize = _quantizer(weight)
            return any_rows(lambda x, bias: blockwise_linear(x, qd, bs, n, bias, quantize=quantize))
        if path == Path.FP8:
            return _bf16_epilogue(_fp8_plan(weight, m, config))
        from ..kernels.w8a16 import w8a16_linear

        q8 = qd[:n].view(torch.uint8)
        cfg = config if path == Path.TRITON else _triton_default(m, weight)
        if path == Path.TRITON or x_dtype != torch.bfloat16:
            return any_rows(lambda x, bias: w8a16_linear(x, q8, bs, bias, block_scaled=True, config=cfg))
        return _bf16_epilogue(small_m_plan(qd, bs, n, k, m, config))  # strided x: the kernel runs on a copy

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        return self.plan(weight, x.shape[0], x.dtype, tactic)(x, bias)

    def run_sharing(self, x, weight, bias, tactic=None) -> tuple[torch.Tensor, Any] | None:
        """Where the call runs the cuBLAS path (the default above M = 256): the planned call, and the 1x128-quantized
        rows its buffer holds (:func:`cublaslt.linear_plan`); where planned calls do not run, the CUDA quantizer's rows
        and ``torch._scaled_mm``."""
        m = x.shape[0]
        if self.choose(m, weight, tactic).path != Path.CUBLAS:
            return None
        planned = _rows_plan(weight, m, x.dtype)
        if planned:
            return planned.sharing(x, bias)
        rows = _quantized_rows(weight, x)
        return self.run_quantized(x, rows, weight, bias, tactic), rows

    def run_quantized(self, x, rows, weight, bias, tactic=None) -> torch.Tensor | None:
        """cuBLASLt's blockwise GEMM on the shared rows, as the call runs it. Rows made by the other route (cuBLASLt
        planned one member's call and refused another's) are not read: the call quantizes ``x`` itself, the same
        bits. None where the call takes another path (a tuned FP8 tactic)."""
        if self.choose(x.shape[0], weight, tactic).path != Path.CUBLAS:
            return None
        planned = _rows_plan(weight, x.shape[0], x.dtype)
        if isinstance(rows, cublaslt.PlannedRows):
            if planned:
                return planned.on_quantized(rows, x, bias)
            rows = _quantized_rows(weight, x)
        elif planned:
            return planned(x, bias)
        t, n = weight.tensors, weight.out_features
        return blockwise_linear(x, t["qdata"], t["block_scale"], n, bias, quantize=lambda _: rows)

    def gated_plan(self, weight, m, x_dtype, tactic=None):
        """Where the call quantizes its activations (from the crossover on, where the CUDA quantizer is built): the
        product quantized by one kernel from ``gate`` and ``up``, then the GEMM of the call's path and config
        (cuBLASLt's, through its planned call or ``torch._scaled_mm``, or our FP8 kernel's). Below the crossover none:
        the small-M kernel reads bf16 activations, and making the product as it loads them costs more than SiLU and
        the product apart."""
        chosen = self.choose(m, weight, tactic)
        if "fp8_sms" not in weight.info or not chosen.path.quantized:
            return None
        if chosen.path == Path.FP8:
            epilogue = _bf16_epilogue(_fp8_plan(weight, m, chosen.config), gated=True)

            def fp8_route(gate: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
                return epilogue(gate, bias, up)

            return Launch(fp8_route, entry=epilogue.entry)
        planned = _rows_plan(weight, m, x_dtype)
        if planned:  # the route holds the plan itself, whose cuBLASLt handle lives as long as the plan
            return lambda gate, up, bias: planned.gated(gate, up, bias)

        qd, bs, n = weight.tensors["qdata"], weight.tensors["block_scale"], weight.out_features  # not the weight

        def run(gate: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return blockwise_linear(gate, qd, bs, n, bias, quantize=lambda g: fp8_gemm.quantize_1x128(g, up=up))

        return run

    def gated_from(self, weight: PreparedWeight) -> int | None:
        """The crossover, from which every path quantizes activations, where the CUDA quantizer is built."""
        return weight.info["crossover"] if "fp8_sms" in weight.info else None

    def row_layout(self, weight: PreparedWeight) -> dict[str, int]:
        return BLOCK128_ROWS

    def joined_info(self, members: Sequence[PreparedWeight], out_features: int) -> dict[str, Any]:
        """The recipe's crossover for the joined weight's size, whatever the members' (the regime each M runs in
        follows the kernels that stream the weight); the rest is the device's, the same for all."""
        info = run_time_info(members[0])
        return {
            **info,
            "crossover": hybrid_crossover(
                out_features,
                members[0].in_features,
                small_m=info["small_m"],
                fp8="fp8_sms" in info,
                table=thresholds.for_device(members[0].device),
            ),
        }

    def export_mx(self, weight: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        t = weight.tensors
        return block128_to_mx(t["qdata"], t["block_scale"], weight.out_features, weight.in_features)


def _blockwise_plan(weight: PreparedWeight, m: int, x_dtype: torch.dtype):
    """The CUDA quantizer and cuBLASLt in one call, planned once for M (:func:`cublaslt.linear_plan`), where planned
    calls run here; else None, and M runs through ``torch._scaled_mm`` (the same numerics)."""
    if not weight.info.get("blockwise_plan"):
        return None
    try:
        return cublaslt.linear_plan(
            weight.tensors["qdata"], weight.tensors["block_scale"], weight.out_features, weight.in_features, m, x_dtype
        )
    except RuntimeError as exc:
        logger.warning("mxgemm: %s; M=%d runs through torch._scaled_mm", exc, m)
        return None


def _rows_plan(weight: PreparedWeight, m: int, x_dtype: torch.dtype):
    """The planned call that shares its quantized rows (:meth:`HybridSM90Backend.run_sharing`) for M, made once and
    kept beside the weight's plans for its own calls; False where planned calls do not run."""
    return weight.cached("shared", (m, x_dtype), lambda: _blockwise_plan(weight, m, x_dtype) or False)


def _quantized_rows(weight: PreparedWeight, x: torch.Tensor):
    """``x``'s rows as the cuBLAS path's quantizer makes them, from a contiguous copy where they are strided."""
    return _quantizer(weight)(x if x.stride(1) == 1 else x.contiguous())


def _quantizer(weight: PreparedWeight):
    """The cuBLAS path's 1x128 activation quantizer: the CUDA one where built, else Triton's (the same bits)."""
    if "fp8_sms" in weight.info:
        return fp8_gemm.quantize_1x128
    from ..kernels.act_quant import quantize_1x128_padded

    return quantize_1x128_padded


def _triton_default(m: int, weight: PreparedWeight):
    from ..kernels.w8a16 import default_config

    return default_config(m, weight.out_features, weight.in_features, block_scaled=True)


def _bf16_epilogue(launch: Launch, gated: bool = False) -> Launch:
    """``(x, bias) -> y`` in ``x.dtype`` around a launch ``(x, bias)`` that writes bf16 [..., N] and adds a contiguous
    bf16 bias in its epilogue: any other bias is added after it, and fp16 callers get the output converted. ``gated``:
    ``(gate, bias, up) -> y`` around the launch's ``gated(gate, up, bias)``. It keeps the launch, whose plans (and
    their CUDA graphs) live as long as the launch does, and takes its entry (the C++ call of bf16 activations, its
    bias checked as here)."""
    planned = launch.gated if gated else launch
    run = planned.run  # the launcher itself: one Python call less

    def call(x: torch.Tensor, bias: torch.Tensor | None, *up: torch.Tensor) -> torch.Tensor:
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return (run(x, *up, None) + bias.to(torch.bfloat16)).to(x.dtype)
        y = run(x, *up, bias)
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)

    return Launch(call, entry=planned.entry, keep=launch)
