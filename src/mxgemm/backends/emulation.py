"""``emulation``: every recipe in plain torch, fp32 arithmetic. Runs anywhere; the reference for the other backends."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from ..block128 import (
    BLOCK128_ROWS,
    block128_to_mx,
    dequantize_1x128,
    dequantize_block128,
    grouped_block128_to_mx,
    prepare_grouped_block128,
    quantize_1x128,
    reencode_block128,
)
from ..device import DeviceInfo
from ..format import MXTensor, dequantize, quantize
from ..recipes import MX_ACT_SCALE_MODE, RECIPES, Recipe, hybrid_crossover
from .base import Availability, Backend, PreparedGroupedWeight, PreparedWeight, run_time_info
from .capabilities import GatedInput, GroupedWeights, JoinsRows, SharesQuantizedInput

__all__ = ["EmulationBackend", "emulate_linear"]


def _effective_weight(weight: PreparedWeight, expert: int | None = None) -> torch.Tensor:
    """The weight the recipe multiplies, in fp32 (``expert``: that expert's of a grouped weight)."""
    t = weight.tensors if expert is None else {name: v[expert] for name, v in weight.tensors.items()}
    if Recipe(weight.recipe).block128:
        return dequantize_block128(t["qdata"], t["block_scale"])
    return dequantize(MXTensor(t["qdata"], t["scale"]))


def _quantizes(m: int, weight: PreparedWeight) -> bool:
    """Whether the recipe quantizes the activations of M rows (all but w8a16's, and the hybrid recipe's below its
    crossover)."""
    recipe = weight.recipe
    return not (recipe == Recipe.W8A16 or (recipe == Recipe.HYBRID_BLOCK128 and m < weight.info["crossover"]))


def _effective_activation(x: torch.Tensor, weight: PreparedWeight) -> torch.Tensor:
    if not _quantizes(x.shape[0], weight):
        return x.float()
    if weight.recipe == Recipe.W8A8_MX:
        return dequantize(quantize(x, scale_mode=MX_ACT_SCALE_MODE))
    return dequantize_1x128(*quantize_1x128(x))


def _product(a: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    y = a @ _effective_weight(weight).T
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def emulate_linear(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact emulated twin of ``weight.recipe``: what a fast backend of that recipe computes, in fp32. Any
    backend's prepared weight of a block recipe will do (the hybrid recipe's crossover is read from it)."""
    return _product(_effective_activation(x, weight), weight, bias, x.dtype)


class EmulationBackend(Backend, JoinsRows, SharesQuantizedInput, GatedInput, GroupedWeights):
    name = "emulation"
    recipes = tuple(RECIPES)
    # grouped weights run every row in one regime: the hybrid recipe's regime would hang on each expert's row count
    grouped_recipes = tuple(r for r in RECIPES if r != Recipe.HYBRID_BLOCK128)
    summary = "dequantize + fp32 matmul in plain torch; the reference (slow)"

    def check_device(self, device: DeviceInfo) -> Availability:
        return Availability(True, "runs anywhere (plain torch, fp32); the reference, not fast")

    def prepare(
        self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str, crossover: int | None = None
    ) -> PreparedWeight:
        """``crossover``: for ``hybrid-block128``, the M from which activations are quantized (default: the recipe's
        crossover for this shape, :func:`mxgemm.recipes.hybrid_crossover`)."""
        n, k = qdata.shape
        if Recipe(recipe).block128:
            block = reencode_block128(qdata, scale)
            tensors = {"qdata": block.qdata, "block_scale": block.scale}
            info = {"reencode": block.report, "crossover": crossover or hybrid_crossover(n, k)}
        else:
            tensors, info = {"qdata": qdata, "scale": scale}, {}
        return PreparedWeight(self.name, recipe, n, k, tensors, info)

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        return emulate_linear(x, weight, bias)

    def run_sharing(self, x, weight, bias, tactic=None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Shared rows: the dequantized activations the call multiplies, where its recipe quantizes them at this M."""
        if not _quantizes(x.shape[0], weight):
            return None
        rows = _effective_activation(x, weight)
        return self.run_quantized(x, rows, weight, bias), rows

    def run_quantized(self, x, rows, weight, bias, tactic=None) -> torch.Tensor:
        return _product(rows, weight, bias, x.dtype)

    def gated_plan(self, weight, m, x_dtype, tactic=None):
        """The product as the model computes it, quantized as :meth:`run_sharing` quantizes an input: the twin of a
        backend's gated quantizer; None where the recipe does not quantize M rows."""
        if not _quantizes(m, weight):
            return None
        ref = weakref.ref(weight)

        def run(gate: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            product = torch.nn.functional.silu(gate) * up
            return self.run_quantized(product, _effective_activation(product, ref()), ref(), bias)

        return run

    def gated_from(self, weight) -> int | None:
        if weight.recipe == Recipe.W8A16:
            return None
        return weight.info["crossover"] if weight.recipe == Recipe.HYBRID_BLOCK128 else 1

    def joined_info(self, members: Sequence[PreparedWeight], out_features: int) -> dict:
        """Hybrid weights whose crossovers are all the recipe's for their sizes: the recipe's for the joined size;
        crossovers given to :meth:`prepare` must be the same, and stay."""
        if all(
            "crossover" in w.info and w.info["crossover"] == hybrid_crossover(w.out_features, w.in_features)
            for w in members
        ):
            return {**run_time_info(members[0]), "crossover": hybrid_crossover(out_features, members[0].in_features)}
        return super().joined_info(members, out_features)

    def row_layout(self, weight: PreparedWeight) -> dict[str, int]:
        return BLOCK128_ROWS if "block_scale" in weight.tensors else {"qdata": 1, "scale": 1}

    def export_mx(self, weight: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        t = weight.tensors
        if "block_scale" in t:
            return block128_to_mx(t["qdata"], t["block_scale"], weight.out_features, weight.in_features)
        return t["qdata"], t["scale"]

    def prepare_grouped(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedGroupedWeight:
        """Each expert as :meth:`prepare` prepares a dense weight (block recipes: re-encoded to 128x128 blocks, the
        report of the expert it changes most kept), stacked."""
        e, n, k = qdata.shape
        if Recipe(recipe).block128:
            tensors, info = prepare_grouped_block128(qdata, scale)
        else:
            tensors, info = {"qdata": qdata, "scale": scale}, {}
        return PreparedGroupedWeight(self.name, recipe, n, k, tensors, info, experts=e)

    def run_grouped(self, x, weight, offsets, tactic=None) -> torch.Tensor:
        """Every expert's product on every row, each row keeping its own expert's (a mask from ``offsets``, read on
        the device): the recipe's numerics per row, at E times the work of the rows alone."""
        rows = torch.arange(x.shape[0], device=x.device)
        ends = offsets.to(torch.int64)
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        a = _effective_activation(x, weight)  # per-row quantization: the same for a row whatever rows run with it
        y = torch.zeros(x.shape[0], weight.out_features, dtype=torch.float32, device=x.device)
        for e in range(weight.experts):
            mine = ((rows >= starts[e]) & (rows < ends[e])).unsqueeze(1)
            y = torch.where(mine, a @ _effective_weight(weight, e).T, y)
        return y.to(x.dtype)

    def export_grouped_mx(self, weight: PreparedGroupedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        t = weight.tensors
        if "block_scale" not in t:
            return t["qdata"], t["scale"]
        return grouped_block128_to_mx(t["qdata"], t["block_scale"])
