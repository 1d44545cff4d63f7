"""Prepared weights and the functional linear: ``prepare_weight`` once at load, ``linear`` every call."""

from __future__ import annotations

import torch

from .backends import PreparedWeight
from .format import check_mx_pair
from .ops import linear_op
from .resolve import resolve_and_prepare

__all__ = ["ACTIVATION_DTYPES", "PreparedWeight", "linear", "prepare_weight"]

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


def prepare_weight(
    qdata: torch.Tensor, scale: torch.Tensor, *, backend: str | None = None, recipe: str | None = None
) -> PreparedWeight:
    """Resolve a backend for this weight on its device and prepare the weight for it, once.

    ``qdata``: float8_e4m3fn (or e5m2) ``[N, K]``; ``scale``: uint8 E8M0 ``[N, K/32]`` (checkpoint layout).
    ``backend``: a name or ``"auto"``; None reads ``$MXGEMM_BACKEND``. ``recipe``: None takes the backend's own.
    """
    check_mx_pair(qdata, scale)
    if qdata.dim() != 2:
        raise ValueError(f"a linear weight must be 2-D [N, K], got shape {tuple(qdata.shape)}")
    return resolve_and_prepare(qdata, scale, backend, recipe=recipe)


def _check_inputs(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None) -> None:
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"activations must be bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != weight.in_features:
        raise ValueError(f"input's last dimension must be in_features={weight.in_features}, got shape {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"input is on {x.device} but the weight is prepared on {weight.device}")
    if bias is not None and (bias.shape != (weight.out_features,) or bias.device != x.device):
        raise ValueError(
            f"bias must have shape ({weight.out_features},) on {x.device}, got {tuple(bias.shape)} on {bias.device}"
        )


def linear(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for ``x`` of shape ``[..., K]``, on the backend the weight was prepared for."""
    _check_inputs(x, weight, bias)
    x2 = x.reshape(-1, weight.in_features)
    if x2.shape[0] == 0:
        y = x2.new_empty((0, weight.out_features))
    else:
        y = linear_op(x2, weight.op_tensors, bias, weight.backend, weight.op_meta)
    return y.reshape(*x.shape[:-1], weight.out_features)
