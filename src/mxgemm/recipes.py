"""The recipes: what a backend computes from an MXFP8 weight, named once. Backends declare the recipes they compute;
the emulation backend computes each in plain torch (their exact twins). The numerics of the 128x128-block recipes
live in :mod:`mxgemm.block128`."""

from __future__ import annotations

from enum import Enum

from .thresholds import SM90, Thresholds

__all__ = ["MX_ACT_SCALE_MODE", "RECIPES", "Recipe", "StrEnum", "hybrid_crossover"]


class StrEnum(str, Enum):
    """Members equal to, printed as and serialized as their strings (Python 3.11's ``enum.StrEnum``, for 3.10)."""

    __str__ = str.__str__
    __format__ = str.__format__


class Recipe(StrEnum):
    """A recipe's name; equal to its string (``Recipe.W8A16 == "w8a16"``), as it appears in files and messages."""

    W8A16 = "w8a16"
    W8A8_MX = "w8a8-mx"
    W8A8_BLOCK = "w8a8-block"
    HYBRID_BLOCK128 = "hybrid-block128"

    @property
    def description(self) -> str:
        return RECIPES[self]

    @property
    def block128(self) -> bool:
        """Whether the weight is re-encoded to 128x128 blocks."""
        return self in (Recipe.W8A8_BLOCK, Recipe.HYBRID_BLOCK128)


RECIPES: dict[Recipe, str] = {
    Recipe.W8A16: "activations as given (bf16/fp16); MXFP8 weight dequantized exactly",
    Recipe.W8A8_MX: "activations quantized to MXFP8 (1x32, E8M0); MXFP8 weight",
    Recipe.W8A8_BLOCK: "activations quantized to FP8 with FP32 scales per 1x128; weight re-encoded to 128x128 blocks",
    Recipe.HYBRID_BLOCK128: "weight re-encoded to 128x128 blocks; M < crossover: activations as given, else as "
    "w8a8-block",
}

MX_ACT_SCALE_MODE = "floor"  # w8a8-mx quantizes activations with the OCP scale rule
SMALL_M_MAX = 16  # the largest M the small-M CUDA kernel of the hybrid recipe runs (two 8-token MMA tiles)


def hybrid_crossover(n: int, k: int, small_m: bool = True, fp8: bool = False, table: Thresholds = SM90) -> int:
    """``hybrid-block128``'s crossover for an ``[n, k]`` weight: the M from which activations are quantized per 1x128
    (below it they are taken as given). It depends on the kernels that run the weight (``small_m``: the small-M CUDA
    kernel is built; ``fp8``: the hand-written FP8 GEMM is), so that each regime runs where it is faster, and on the
    switch points measured for the device's architecture (``table``, :mod:`mxgemm.thresholds`); never inside the
    small-M kernel's rows where it runs, save M = 1 for large weights where the FP8 kernel does. A prepared weight
    records its crossover (``info["crossover"]``), and its emulated twin reads it from there."""
    t = table
    if n * k >= t.crossover_large_elements:
        return 1 if fp8 or not small_m else SMALL_M_MAX + 1
    if fp8:
        return t.crossover_mid_m if n * k >= t.crossover_mid_elements else SMALL_M_MAX + 1
    rule = t.crossover_deep_m if k >= t.crossover_deep_k else t.crossover_m
    return max(rule, SMALL_M_MAX + 1) if small_m else rule
