"""Grouped weights of a mixture of experts: ``prepare_grouped_weight`` once at load, ``grouped_linear`` every call.

A projection of E experts is one ``[E, N, K]`` MX weight (checkpoints store it per expert; transformers stacks it).
Its prepared copy is made once for a backend with :class:`mxgemm.backends.capabilities.GroupedWeights`, chosen by the
resolver as a dense weight's is. A call takes the rows of all experts sorted by expert and their cumulative ends
``offsets`` (int32 ``[E]``, the convention of ``torch._grouped_mm`` and of transformers' ``grouped_mm`` experts): one
op, ``mxgemm::grouped_linear``, whose output shape does not depend on the routing and whose offsets stay on the
device, so that a decode step captures in a CUDA graph and compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import torch

from .backends import PreparedGroupedWeight, PreparedWeight
from .format import check_mx_pair, e8m0_bytes
from .ops import grouped_linear_op
from .resolve import resolve_and_prepare
from .weights import ACTIVATION_DTYPES

__all__ = ["PreparedGroupedWeight", "check_grouped", "grouped_linear", "prepare_grouped_weight"]


def prepare_grouped_weight(
    qdata: torch.Tensor, scale: torch.Tensor, *, backend: str | None = None, recipe: str | None = None
) -> PreparedGroupedWeight:
    """Resolve a backend that runs grouped weights on this weight's device and prepare it there, once.

    ``qdata``: float8_e4m3fn (or e5m2) ``[E, N, K]``; ``scale``: uint8 (or float8_e8m0fnu) E8M0 ``[E, N, K/32]``.
    ``backend``: a name or ``"auto"``; None reads ``$MXGEMM_BACKEND``; a named backend that does not run grouped
    weights raises :class:`mxgemm.BackendUnavailableError` saying so. ``recipe``: None takes the backend's first
    grouped recipe."""
    check_mx_pair(qdata, scale)
    if qdata.dim() != 3 or qdata.shape[0] == 0:
        raise ValueError(f"grouped weights must be 3-D [E, N, K] with E >= 1, got shape {tuple(qdata.shape)}")
    return resolve_and_prepare(qdata, e8m0_bytes(scale), backend, recipe=recipe)


def grouped_linear(x: torch.Tensor, weight: PreparedGroupedWeight, offsets: torch.Tensor) -> torch.Tensor:
    """``x`` [S, K] (bf16/fp16), its rows sorted by expert, -> [S, N] in ``x.dtype``: row ``i`` times the weight of
    expert ``e`` where ``offsets[e-1] <= i < offsets[e]`` (expert 0 from row 0). ``offsets``: int32 ``[E]``
    cumulative row ends on ``x``'s device, non-decreasing (not checked: that would read them on the host); rows at
    or past ``offsets[-1]`` answer zeros; an expert with no rows costs nothing but its offset."""
    check_grouped(weight, "weight")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"activations must be bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [S, {weight.in_features}] (rows sorted by expert), got shape {tuple(x.shape)}")
    if offsets.dtype != torch.int32 or offsets.shape != (weight.experts,):
        raise ValueError(
            f"offsets must be int32 [{weight.experts}] (each expert's cumulative row end), got {offsets.dtype} "
            f"{tuple(offsets.shape)}"
        )
    if x.device != weight.device or offsets.device != weight.device:
        raise ValueError(
            f"x and offsets must be on {weight.device}, where the weight is; got {x.device}, {offsets.device}"
        )
    return grouped_linear_op(x, offsets, weight.op_tensors, weight.backend, weight.op_meta)


def check_grouped(weight: object, name: str) -> None:
    """Raise a one-line TypeError naming ``name`` unless ``weight`` is a :class:`PreparedGroupedWeight`."""
    if not isinstance(weight, PreparedGroupedWeight):
        hint = "; a dense weight runs through mxgemm.linear" if isinstance(weight, PreparedWeight) else ""
        raise TypeError(
            f"{name} must be a PreparedGroupedWeight (mxgemm.prepare_grouped_weight), got {type(weight).__name__}{hint}"
        )
