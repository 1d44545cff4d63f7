"""Where mxgemm's default routes switch, as measured: one table per GPU architecture.

Each value is the point from which one route beats another in a measurement that docs/performance.md records (the
section named beside the field). SM90 is the only architecture measured; a GPU of another one takes SM90's table
(the tuner's files, keyed by GPU, are where a device's own measurements go). Tactic lists and kernel limits are not
here: they bound what is tried, not what runs by default.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["MEASURED", "SM90", "Thresholds", "for_device", "for_sm"]


@dataclass(frozen=True)
class Thresholds:
    """The switch points of one architecture's default routes, and the GPUs they were measured on."""

    measured_on: str
    # hybrid-block128's crossover (the M from which activations are quantized per 1x128), where the FP8 kernel runs:
    # M = 1 on weights of at least crossover_large_elements elements, crossover_mid_m on those of
    # crossover_mid_elements or more, else where the small-M kernel's rows end ("The regimes of hybrid_sm90 and what
    # limits each": the crossover)
    crossover_large_elements: int
    crossover_mid_elements: int
    crossover_mid_m: int
    # ... where it does not (cuBLASLt against the Triton kernel): M = 1 on the large weights as above,
    # crossover_deep_m from K = crossover_deep_k, else crossover_m (the same section and bullet)
    crossover_deep_k: int
    crossover_deep_m: int
    crossover_m: int
    # triton (w8a16): from this M, the weight dequantized into bf16 for cuBLAS instead of the exact kernel
    # ("The regimes of hybrid_sm90 and what limits each": dequantize + cuBLAS against the Triton kernel)
    dequant_min_m: int
    # a group of layers reading one input (fusion.SharedInput) runs as one GEMM up to this many rows, each member's
    # own GEMM above ("Eager calls and whole models": the prefill with groups and with members apart)
    shared_input_max_rows: int
    # ... up to this many rows for groups whose outputs are read at full speed as views: q/k/v, and the gate/up of a
    # gated MLP whose product down_proj reads quantized (the same section: the groups at 1024 and 4096 rows)
    joined_max_rows: int
    # triton's grouped weights: the wgmma kernel from this many rows per expert of an even routing ("Mixtures of
    # experts": the wgmma kernel against the Triton kernel, grouped-wgmma-h100.txt)
    grouped_wgmma_from: int
    # ... and at any rows from this K (the same section: `mxgemm tune --moe`, tune-moe-h100.txt)
    grouped_wgmma_deep_k: int
    # ... with 64-row tiles, its persistent grid (CTAs taking tiles in turn) up to this K, a CTA per tile above (the
    # same section: the persistent grid against a CTA per tile); 128-row tiles on the persistent grid at any K
    grouped_persistent_max_k: int
    # the GEMV (kernels/grouped/gemv.py) where a call's rows are at most 2 or the experts over this, so that each
    # active expert has about one row, as at one token ("Mixtures of experts": the GEMV against the grouped kernels,
    # gemv-decode-stages1-h100.txt, and the tuner's choices, tune-moe-h100-m1-4-16-64.txt)
    grouped_gemv_experts_per_row: int


SM90 = Thresholds(
    measured_on="NVIDIA H200 (dense routes) and H100 80GB HBM3 (grouped weights)",
    crossover_large_elements=96 * 2**20,
    crossover_mid_elements=32 * 2**20,
    crossover_mid_m=16,
    crossover_deep_k=12288,
    crossover_deep_m=96,
    crossover_m=48,
    dequant_min_m=256,
    shared_input_max_rows=1024,
    joined_max_rows=4096,
    grouped_wgmma_from=8,
    grouped_wgmma_deep_k=4096,
    grouped_persistent_max_k=2048,
    grouped_gemv_experts_per_row=8,
)

_TABLES: dict[int, Thresholds] = {90: SM90}
MEASURED = frozenset(_TABLES)  # the architectures with a table of their own


def for_sm(sm: int | None) -> Thresholds:
    """The table of architecture ``sm`` (90 for SM90), else SM90's, the only one measured."""
    return _TABLES.get(sm, SM90)


def for_device(device: torch.device) -> Thresholds:
    """:func:`for_sm` of ``device``'s architecture (a CPU, running the kernels under Triton's interpreter: SM90's)."""
    if device.type != "cuda":
        return for_sm(None)
    return for_sm(_sm(device.index if device.index is not None else torch.cuda.current_device()))


@functools.cache
def _sm(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor
