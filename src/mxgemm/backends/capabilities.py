"""What a backend may offer beyond :class:`Backend`'s narrow contract, each capability opted into by subclassing it.

Callers ask ``isinstance(backend, Capability)``; a backend without it is never asked, so none carries hooks it does
not implement. A new problem kind (grouped weights of a mixture of experts) is a new capability here, taken by the
backends that run it.

- :class:`JoinsRows`: weights that read the same input can be joined by rows into one prepared weight
  (:mod:`mxgemm.fusion`).
- :class:`SharesQuantizedInput`: a call quantizes its input apart from its GEMM and can hand those rows to the calls of
  other weights of the same input.
- :class:`GatedInput`: a call can quantize a gated MLP's product ``silu(gate) * up`` in one kernel with its input.
- :class:`GroupedWeights`: the ``[E, N, K]`` weights of a mixture of experts, run on rows sorted by expert.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from ..availability import Availability
from ..device import DeviceInfo
from ..recipes import Recipe
from .base import PreparedGroupedWeight, PreparedWeight, run_time_info

__all__ = ["GatedInput", "GroupedWeights", "JoinsRows", "SharesQuantizedInput"]


class JoinsRows(ABC):
    """Prepared weights that split by output rows, so that weights of one input join into one."""

    @abstractmethod
    def row_layout(self, weight: PreparedWeight) -> dict[str, int] | None:
        """How the prepared tensors hold the output rows: for each tensor, the output rows one of its rows covers, its
        rows in output order; None where this weight's layout does not split so. Row padding makes a weight unfit
        (checked by the caller)."""

    def joined_info(self, members: Sequence[PreparedWeight], out_features: int) -> dict[str, Any]:
        """The run-time info of the weight that joins ``members`` along the output rows into ``out_features`` rows,
        their re-encoding reports aside; raises ValueError (why) where they cannot be one weight. This default: their
        info, which must be the same."""
        first = run_time_info(members[0])
        for w in members[1:]:
            info = run_time_info(w)
            differ = sorted(k for k in first.keys() | info.keys() if first.get(k) != info.get(k))
            if differ:
                raise ValueError(f"they differ in {', '.join(differ)}")
        return first


class SharesQuantizedInput(ABC):
    """Calls that quantize their input apart from the GEMM, whose quantized rows other weights' calls can read."""

    @abstractmethod
    def run_sharing(
        self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic: Any = None
    ) -> tuple[torch.Tensor, Any] | None:
        """(``y``, ``rows``): what the weight's call with ``tactic`` (the caller's, resolved once for the call's M:
        :func:`mxgemm.ops.call_tactic`) answers for ``x`` [M, K], and ``x``'s activations as that call quantized them
        apart from its GEMM, for the calls of weights that read the same input to share through
        :meth:`run_quantized`; None where this call quantizes nothing apart: the weight then runs its own call."""

    @abstractmethod
    def run_quantized(
        self, x: torch.Tensor, rows: Any, weight: PreparedWeight, bias: torch.Tensor | None, tactic: Any = None
    ) -> torch.Tensor | None:
        """What the weight's call with ``tactic`` answers for ``x`` [M, K], from the ``rows`` :meth:`run_sharing`
        answered for ``x`` (on any weight of the same input size and regime); None where that call does not read such
        rows (the caller then runs it)."""


class GatedInput(ABC):
    """Calls that can take a gated MLP's product as two inputs, quantized by one kernel with the GEMM's input."""

    @abstractmethod
    def gated_plan(
        self, weight: PreparedWeight, m: int, x_dtype: torch.dtype, tactic: Any = None
    ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
        """Where the weight's call of M rows with ``tactic`` quantizes its input: ``(gate, up, bias) -> y``, what that
        call answers for the input ``silu(gate) * up`` ([M, K] each with unit stride along K, the product as a gated
        MLP computes it in their dtype), the product quantized by one kernel that reads ``gate`` and ``up``. None
        elsewhere: the caller then computes the product and runs the weight on it (:mod:`mxgemm.gated`). A route is
        kept with the weight's plans, so it must not hold the weight."""

    @abstractmethod
    def gated_from(self, weight: PreparedWeight) -> int | None:
        """The fewest rows a layer asks :meth:`gated_plan` for (calls of fewer run the model's own steps at the cost of
        one comparison), or None where it never asks."""


class GroupedWeights(ABC):
    """The experts of a mixture of experts: ``E`` weights ``[N, K]`` of one projection prepared as one, run on the rows
    of each expert (sorted by expert, ``offsets`` their cumulative ends) in one call, with no host synchronisation."""

    grouped_recipes: ClassVar[tuple[Recipe, ...]]  # the recipes it computes grouped weights in; the first its default

    def check_grouped(self, device: DeviceInfo) -> Availability:
        """Can it run grouped weights on ``device``, where :meth:`Backend.check_device` already passed? Never raises;
        the reason says what is missing. This default: wherever the backend runs."""
        return Availability(True, "wherever the backend runs")

    @abstractmethod
    def prepare_grouped(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedGroupedWeight:
        """Turn checkpoint tensors (float8 ``[E, N, K]``, uint8 E8M0 ``[E, N, K/32]``) into this backend's prepared
        grouped weight, once."""

    def grouped_tactics(self, per_expert: int, weight: PreparedGroupedWeight, active: int | None = None) -> list[Any]:
        """Tactics the autotuner may try for ``per_expert`` rows on each of ``active`` experts (None: all; the buckets
        of an even routing); the first is the default :meth:`run_grouped` takes for them and always valid. This
        default: that one alone."""
        return [None]

    @abstractmethod
    def run_grouped(
        self, x: torch.Tensor, weight: PreparedGroupedWeight, offsets: torch.Tensor, tactic: Any = None
    ) -> torch.Tensor:
        """``x`` [S, K] (bf16/fp16, rows sorted by expert) -> [S, N] in ``x.dtype``: row ``i`` through the weight of
        the expert ``e`` with ``offsets[e-1] <= i < offsets[e]`` (``offsets`` int32 ``[E]``, non-decreasing, on
        ``x``'s device; expert 0 starts at row 0); rows at or past ``offsets[-1]`` answer zeros. Inputs are already
        validated; the offsets' values are not read on the host."""

    def plan_experts(
        self,
        gate_up: PreparedGroupedWeight,
        down: PreparedGroupedWeight,
        tokens: int,
        topk: int,
        x_dtype: torch.dtype,
        tactics: tuple[Any, Any] = (None, None),
    ) -> Callable[..., torch.Tensor]:
        """What an eager call of :meth:`run_experts` on ``tokens`` tokens of ``topk`` copies in ``x_dtype`` with
        ``tactics`` runs: ``(x, topk_ids, topk_weights, gate_up, down) -> y``, the same bits, with whatever the shape
        fixes worked out once. It lives in ``gate_up.plans.experts`` and takes both weights at each call (it holds
        neither: see :meth:`Backend.plan`). This default: :meth:`run_experts`."""
        return lambda x, ids, weights, gu, dn: self.run_experts(x, ids, weights, gu, dn, tactics)

    def run_experts(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        gate_up: PreparedGroupedWeight,
        down: PreparedGroupedWeight,
        tactics: tuple[Any, Any] = (None, None),
    ) -> torch.Tensor:
        """The routed block of :func:`mxgemm.moe_experts` (inputs validated; ``x`` bf16/fp16 [T, H], ``topk_weights``
        in its dtype): each token copy ``t * k + j`` through expert ``topk_ids[t, j]``'s ``gate_up``, ``silu(gate) *
        up`` in ``x``'s dtype, ``down``, then ``sum_j round(y_j * topk_weights[t, j])`` in fp32 over j in turn,
        rounded to ``x``'s dtype; a copy routed outside ``[0, E)`` adds zero. ``tactics``: the two projections' (the
        caller's, for the ``T * k`` rows). This default: the copies sorted by expert and gathered, two
        :meth:`run_grouped` calls, the product between them, and the copies put back."""
        tokens, k = topk_ids.shape
        groups = torch.where((topk_ids >= 0) & (topk_ids < gate_up.experts), topk_ids, gate_up.experts).reshape(-1)
        order = torch.argsort(groups, stable=True)  # each expert's copies in token order, then the unrouted ones
        counts = torch.zeros(gate_up.experts + 1, dtype=torch.int64, device=x.device)
        counts.index_add_(0, groups.long(), torch.ones_like(groups, dtype=torch.int64))
        offsets = counts.cumsum(0)[:-1].to(torch.int32)
        gate, up = self.run_grouped(x[order // k], gate_up, offsets, tactics[0]).chunk(2, dim=-1)
        y = self.run_grouped(torch.nn.functional.silu(gate) * up, down, offsets, tactics[1])
        copies = torch.empty_like(y).index_copy_(0, order, y).reshape(tokens, k, -1)
        out = torch.zeros(tokens, y.shape[1], dtype=torch.float32, device=x.device)
        for j in range(k):
            out += copies[:, j] * topk_weights[:, j : j + 1]
        return out.to(x.dtype)

    @abstractmethod
    def export_grouped_mx(self, weight: PreparedGroupedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        """The MX tensors (float8 ``[E, N, K]``, uint8 E8M0 ``[E, N, K/32]``) that dequantize to exactly the weights
        this backend computes with."""
