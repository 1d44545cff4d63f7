"""Prepared weights and the functional linear: ``prepare_weight`` once at load, ``linear`` every call."""

from __future__ import annotations

import torch

from . import autotune
from .backends import PreparedWeight, get_backend
from .format import check_mx_pair, e8m0_bytes
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
    scale = e8m0_bytes(scale)
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
    """``y = x @ W^T (+ bias)`` for ``x`` of shape ``[..., K]``, on the backend the weight was prepared for.

    Traced (``torch.compile``, export, fake or subclass tensors, autograd) the call is one ``mxgemm::linear`` op;
    eager it runs the same backend code directly, through the weight's launch plan for this M (the op's Python
    wrapper alone costs several times a kernel launch)."""
    _check_inputs(x, weight, bias)
    flat = x.dim() == 2
    x2 = x if flat else x.reshape(-1, weight.in_features)
    if x2.shape[0] == 0:
        y = x2.new_empty((0, weight.out_features))
    elif _direct(x2, bias):
        y = run_planned(x2, weight, bias)
    else:
        y = linear_op(x2, weight.op_tensors, bias, weight.backend, weight.op_meta)
    return y if flat else y.reshape(*x.shape[:-1], weight.out_features)


_MAX_PLANS = 256  # per weight; a workload with more distinct M starts over


def _direct(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a call may skip the op: plain tensors, nothing tracing it, no gradient asked for."""
    if type(x) is not torch.Tensor or (bias is not None and type(bias) is not torch.Tensor):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    return not torch.compiler.is_compiling()


def run_planned(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Run ``x`` [M, K] through the weight's plan for (M, dtype), made on first use with the tactic the op would
    take (:func:`mxgemm.autotune.tactic_for_call`, which reads ``MXGEMM_AUTOTUNE`` then); a plan is remade when
    tuning changes the cache."""
    key = (x.shape[0], x.dtype, autotune.generation())
    plan = weight.plans.get(key)
    if plan is None:
        backend = get_backend(weight.backend)
        plan = backend.plan(weight, x.shape[0], x.dtype, autotune.tactic_for_call(backend, weight, x))
        if len(weight.plans) >= _MAX_PLANS:
            weight.plans.clear()
        weight.plans[key] = plan
    return plan(x, bias)
