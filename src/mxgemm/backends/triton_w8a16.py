"""``triton``: exact ``w8a16`` Triton kernel reading MX weights (fp8 bytes + E8M0 scales) directly; at large M (bf16
activations) the weight is dequantized chunk by chunk into a transient bf16 buffer for cuBLAS instead (same numerics:
``kernels/dequant.py``).

Grouped weights of a mixture of experts (FP8 tensor cores, compute capability 8.9 and up): ``w8a8-block``, each expert
re-encoded to 128x128 blocks once, its rows quantized per 1x128 inside the grouped GEMM (``kernels/grouped/fp8.py``), or
inside the GEMV on CUDA cores (``kernels/grouped/gemv.py``) where a call has about one row an active expert (at most 2
rows, or one for ``grouped_gemv_experts_per_row`` experts); on SM90, from ``grouped_wgmma_from`` rows per expert of an
even routing (at any rows from K = ``grouped_wgmma_deep_k``; :mod:`mxgemm.thresholds`), the rows quantized apart and
multiplied by the TMA/wgmma kernel (``kernels/grouped/wgmma.py``) where nvcc builds it, the same recipe."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import torch

from .. import thresholds
from ..block128 import grouped_block128_to_mx, prepare_grouped_block128
from ..device import DeviceInfo
from ..format import BLOCK_SIZE, E8M0_NAN
from ..recipes import Recipe, StrEnum
from .base import Availability, Backend, PreparedGroupedWeight, PreparedWeight, Tactic, check_reencoding
from .capabilities import GroupedWeights

__all__ = ["TritonBackend", "kernel_scales"]

_MIN_CAPABILITY = (8, 0)  # bf16 and tf32 tensor-core dots
_FP8_CAPABILITY = (8, 9)  # FP8 tensor-core dots: the grouped kernel
_DEQUANT_TACTIC_MIN_M = 64  # dequantize + cuBLAS offered as a tactic from this M (the default from the threshold's)


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


class Path(StrEnum):
    """The kernels that run a call."""

    KERNEL = "kernel"  # the Triton w8a16 kernel
    DEQUANT = "dequant"  # the weight dequantized in chunks (kernels/dequant.py), then cuBLAS bf16
    GROUPED = "grouped"  # grouped weights: the Triton grouped kernel (kernels/grouped/fp8.py)
    WGMMA = "wgmma"  # grouped weights: SM90's TMA/wgmma kernel (kernels/grouped/wgmma.py)


def _default(m: int, weight: PreparedWeight):
    from ..kernels.w8a16 import default_config

    return default_config(m, weight.out_features, weight.in_features, packed_decode=weight.info["packed_decode"])


class TritonBackend(Backend, GroupedWeights):
    name = "triton"
    recipes = (Recipe.W8A16,)
    grouped_recipes = (Recipe.W8A8_BLOCK,)
    tunable = True
    summary = (
        "exact w8a16: a Triton kernel reading MX weights directly; from M = 256 the weight dequantized in chunks for "
        "cuBLAS bf16; any CUDA GPU of SM80+; grouped experts in w8a8-block on SM89+"
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

    def tactics(self, m: int, weight: PreparedWeight) -> list[Tactic]:
        """Kernel configs around the measured default (tile N, tile K, split-K, pipeline depth, decoder) and, from
        M = 64, dequantize + cuBLAS (first from the device's ``dequant_min_m``). Same numerics."""
        base = _default(m, weight)
        out = [Tactic(Path.KERNEL, base)]
        variants = [{"bn": bn} for bn in (32, 64, 128)] + [{"bk": bk} for bk in (64, 128, 256)]
        variants += [{"split_k": s} for s in (1, 2, 4, 8)] + [{"stages": 4}]
        if weight.info["packed_decode"]:
            variants.append({"packed": not base.packed})
        for v in variants:
            t = Tactic(Path.KERNEL, dataclasses.replace(base, **v))
            if t not in out and t.config.fills_splits(weight.in_features):
                out.append(t)
        if m >= thresholds.for_device(weight.device).dequant_min_m:
            return [Tactic(Path.DEQUANT), *out]
        return [*out, Tactic(Path.DEQUANT)] if m >= _DEQUANT_TACTIC_MIN_M else out

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        from ..kernels.w8a16 import w8a16_linear

        q = weight.tensors["qdata"]
        m = x.shape[0]
        dequant = tactic.path == Path.DEQUANT if tactic else m >= thresholds.for_device(x.device).dequant_min_m
        if dequant and x.dtype == torch.bfloat16:
            from ..kernels.dequant import dequant_linear

            e5m2, plain = q.dtype == torch.float8_e5m2, weight.info["plain_scales"]
            return dequant_linear(x, q.view(torch.uint8), weight.tensors["scale"], bias, e5m2=e5m2, plain_scales=plain)
        # fp16 activations: the kernel (exact for them; same recipe), with its default config on a dequant tactic
        config = tactic.config if tactic and tactic.path == Path.KERNEL else _default(m, weight)
        return w8a16_linear(
            x,
            q.view(torch.uint8),
            weight.tensors["scale"],
            bias,
            e5m2=q.dtype == torch.float8_e5m2,
            plain_scales=weight.info["plain_scales"],
            config=config,
        )

    def check_grouped(self, device: DeviceInfo) -> Availability:
        if device.type == "cpu":  # the interpreter (check_device passed)
            return Availability(True, "Triton interpreter on CPU (TRITON_INTERPRET=1): for tests only, very slow")
        if device.capability is None or device.capability < _FP8_CAPABILITY:
            return Availability(
                False, f"grouped weights need FP8 tensor cores (compute capability >= 8.9); {device} is below that"
            )
        t = thresholds.for_sm(device.sm)
        gemv = f"; the GEMV where a call has at most 2 rows or one for {t.grouped_gemv_experts_per_row} experts"
        wgmma = f"; from {t.grouped_wgmma_from} rows per expert (any from K = {t.grouped_wgmma_deep_k}) the wgmma one"
        return Availability(True, f"grouped FP8 Triton kernel on {device}{gemv}" + (wgmma if device.sm == 90 else ""))

    def prepare_grouped(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedGroupedWeight:
        """Each expert re-encoded to 128x128 blocks, unpadded; refused as a dense weight is by ``hybrid_sm90``
        (:func:`check_reencoding`)."""
        e, n, k = qdata.shape
        tensors, info = check_reencoding(qdata, lambda: prepare_grouped_block128(qdata, scale))
        return PreparedGroupedWeight(self.name, recipe, n, k, tensors, info, experts=e)

    def grouped_tactics(
        self, per_expert: int, weight: PreparedGroupedWeight, active: int | None = None
    ) -> list[Tactic]:
        """The default for ``per_expert`` rows on each of ``active`` experts (None: all), then the Triton kernel's
        configs of that regime (in-kernel quantization below 64 rows an expert, rows quantized apart from there; up to 2
        rows an expert, the GEMV's too) and, on SM90 where it builds, the wgmma kernel's tiles and ring depths. The same
        recipe, each within the tensor cores' rounding of the twin; the bits may differ between them in the last place
        (narrower Triton tiles in the routed block, the GEMV's fp32 sums on CUDA cores)."""
        from ..kernels.grouped.fp8 import GroupedConfig as C
        from ..kernels.grouped.gemv import GemvConfig as G
        from ..kernels.grouped.wgmma import WgmmaConfig

        rows = per_expert * (active or weight.experts)
        out = [_default_grouped(rows, weight.experts, weight.device, weight.in_features)]
        if per_expert < 64:
            configs = [C(128, 16), C(64, 16), C(64, 16, 8, 3), C(64, 32), C(128, 32), C(32, 16), C(32, 16, 4, 4)]
            configs += [C(16, 16)]  # narrow: more programs where a few experts are active
            if per_expert <= 2:  # a row or two an expert: one row a program, its weight rows read once a row
                configs += [G(16, 4), G(32, 4), G(64, 2, 8), G(16, 16)]
        else:
            configs = [C(128, 64, 4, 3, True), C(256, 64, 8, 3, True), C(128, 128, 8, 3, True)]
        out += [Tactic(Path.GROUPED, c) for c in configs]
        if _wgmma_runs(weight.device):
            out += [
                Tactic(Path.WGMMA, WgmmaConfig(tn, wn, st, persistent))
                for tn in (64, 128)
                for wn in (64, 128)
                for st in (4, 6)
                for persistent in (False, True)
            ]
        return list(dict.fromkeys(out))

    def run_grouped(self, x, weight, offsets, tactic=None) -> torch.Tensor:
        from ..kernels.grouped.fp8 import grouped_block_linear

        t = weight.tensors
        qd, bs, n = t["qdata"].view(torch.uint8), t["block_scale"], weight.out_features
        tactic = tactic or _default_grouped(x.shape[0], weight.experts, x.device, weight.in_features)
        if tactic.path == Path.WGMMA:
            from ..kernels.grouped.quant import quantize_rows
            from ..kernels.grouped.wgmma import grouped_wgmma

            xq, xs = quantize_rows(x)
            return grouped_wgmma(xq, xs, x.shape[0], qd, bs, offsets, n, x.dtype, tactic.config)
        return grouped_block_linear(x, qd, bs, offsets, n, tactic.config)

    def run_experts(self, x, topk_ids, topk_weights, gate_up, down, tactics=(None, None)) -> torch.Tensor:
        """Four launches: the copies sorted by expert, gate/up on the tokens in place with ``silu(gate) * up`` in its
        epilogue, down writing each copy back to its token's place, and the weighted sum (``kernels/grouped``). Where
        gate/up's tactic is the wgmma kernel, six: the rows gathered and quantized, gate/up, its product quantized,
        down writing each copy back, around the same sort and sum. Down takes its own tactic where it is of gate/up's
        kernel, else that kernel's default."""
        from ..kernels.grouped.fp8 import grouped_down, grouped_gate_up
        from ..kernels.grouped.routing import combine, sort_by_expert

        gu, dn = gate_up.tensors, down.tensors
        gu_q, gu_s = gu["qdata"].view(torch.uint8), gu["block_scale"]
        dn_q, dn_s = dn["qdata"].view(torch.uint8), dn["block_scale"]
        topk = topk_ids.shape[1]
        offsets, src = sort_by_expert(topk_ids, gate_up.experts)
        rows = src.shape[0]
        first, second = _experts_tactics(rows, gate_up, tactics)
        if first.path == Path.WGMMA:
            from ..kernels.grouped.quant import quantize_rows
            from ..kernels.grouped.wgmma import grouped_wgmma

            xq, xs = quantize_rows(x, src, topk)
            h = grouped_wgmma(xq, xs, rows, gu_q, gu_s, offsets, gate_up.out_features, x.dtype, first.config)
            pq, ps = quantize_rows(h, gated=True)
            y = grouped_wgmma(pq, ps, rows, dn_q, dn_s, offsets, down.out_features, x.dtype, second.config, dst=src)
        else:
            product = grouped_gate_up(x, gu_q, gu_s, offsets, src, topk, first.config)
            y = grouped_down(product, dn_q, dn_s, offsets, src, down.out_features, second and second.config)
        return combine(y, topk_weights)

    def plan_experts(self, gate_up, down, tokens, topk, x_dtype, tactics=(None, None)):
        """Where gate/up's tactic is the wgmma kernel, the whole block in one C call
        (:class:`mxgemm.kernels.grouped.wgmma.ExpertsLaunch`: the same seven launches and bits as :meth:`run_experts`,
        without their host time); else :meth:`run_experts`."""
        first, second = _experts_tactics(tokens * topk, gate_up, tactics)
        if first.path != Path.WGMMA or tokens == 0 or gate_up.device.type != "cuda":
            return super().plan_experts(gate_up, down, tokens, topk, x_dtype, tactics)
        from ..kernels.grouped.wgmma import ExpertsLaunch

        return ExpertsLaunch.make(tokens, topk, gate_up, down, x_dtype, first.config, second.config)

    def export_grouped_mx(self, weight: PreparedGroupedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_block128_to_mx(weight.tensors["qdata"], weight.tensors["block_scale"])


def _wgmma_runs(device: torch.device) -> bool:
    """Whether the grouped wgmma kernel runs on ``device``: SM90, the library built (said once on logger ``mxgemm``
    where it does not)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    from ..kernels.grouped.wgmma import wgmma_status

    return bool(wgmma_status((9, 0)))


def _experts_tactics(rows: int, gate_up: PreparedGroupedWeight, tactics: tuple) -> tuple[Tactic, Tactic | None]:
    """The routed block's two tactics for ``rows`` token copies from the caller's (None: the default): gate/up's; down's
    where it is of gate/up's kernel, else (wgmma) that kernel's default or gate/up's config, else (Triton) the GEMV
    where it is the default at these rows, or None, the Triton kernel's default."""
    gemv = _default_gemv(rows, gate_up.experts, gate_up.device)
    default = gemv or _default_kernel(rows, gate_up.experts, gate_up.device, gate_up.in_features)
    first = tactics[0] or default
    second = tactics[1] if tactics[1] is not None and tactics[1].path == first.path else None
    if first.path == Path.WGMMA:
        second = second or (default if default.path == Path.WGMMA else first)
    return first, second or gemv


@functools.cache
def _gemv_tactic() -> Tactic:
    """The GEMV's default launch: 16 weight rows a program, 4 blocks a step."""
    from ..kernels.grouped.gemv import GemvConfig

    return Tactic(Path.GROUPED, GemvConfig(16, 4))


def _default_gemv(rows: int, experts: int, device: torch.device) -> Tactic | None:
    """The GEMV (:func:`_gemv_tactic`) where ``rows`` rows over ``experts`` experts are at most 2 or ``experts /
    grouped_gemv_experts_per_row``: about one row an active expert, each reading its expert's weight rows once; else
    None."""
    if rows > max(2, experts // thresholds.for_device(device).grouped_gemv_experts_per_row):
        return None
    return _gemv_tactic()


def _default_grouped(rows: int, experts: int, device: torch.device, k: int) -> Tactic:
    """The grouped kernel and config for ``rows`` rows over ``experts`` experts (an even routing) of ``k`` columns: the
    GEMV where :func:`_default_gemv` takes it, else :func:`_default_kernel`."""
    return _default_gemv(rows, experts, device) or _default_kernel(rows, experts, device, k)


def _default_kernel(rows: int, experts: int, device: torch.device, k: int) -> Tactic:
    """The grouped kernel for ``rows`` rows over ``experts`` experts of ``k`` columns, the GEMV aside: with
    ``per_expert`` rows an expert, on SM90 from the device's ``grouped_wgmma_from`` rows, or at any rows from K =
    ``grouped_wgmma_deep_k``, the wgmma kernel where it builds (64-row tiles below 128 rows an expert, on its persistent
    grid up to K = ``grouped_persistent_max_k``; 128-row tiles from there, on its persistent grid); else the Triton
    kernel's default."""
    per_expert = -(-rows // max(experts, 1))
    t = thresholds.for_device(device)
    if (per_expert >= t.grouped_wgmma_from or k >= t.grouped_wgmma_deep_k) and _wgmma_runs(device):
        from ..kernels.grouped.wgmma import WgmmaConfig

        tn = 128 if per_expert >= 128 else 64
        persistent = tn == 128 or k <= t.grouped_persistent_max_k
        return Tactic(Path.WGMMA, WgmmaConfig(tn=tn, wn=128, stages=4, persistent=persistent))
    from ..kernels.grouped.fp8 import default_config

    return Tactic(Path.GROUPED, default_config(per_expert, 1))
