"""Prepared weights and the functional linear: ``prepare_weight`` once at load, ``linear`` every call."""

from __future__ import annotations

import torch

from .backends import PreparedGroupedWeight, PreparedWeight, get_backend
from .format import MXTensor, check_mx_pair, dequantize, e8m0_bytes
from .ops import linear_gated_op, linear_op, run_planned
from .resolve import resolve_and_prepare

__all__ = [
    "ACTIVATION_DTYPES",
    "PreparedWeight",
    "check_inputs",
    "linear",
    "op_linear",
    "op_linear_gated",
    "prepare_weight",
    "wants_grad",
]

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


def check_inputs(x: torch.Tensor, k: int, n: int, device: torch.device, bias: torch.Tensor | None) -> None:
    """A call's input and bias against a weight [n, k] on ``device``."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"activations must be bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"input's last dimension must be in_features={k}, got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"input is on {x.device} but the weight is prepared on {device}")
    if bias is not None and (bias.shape != (n,) or bias.device != x.device):
        raise ValueError(f"bias must have shape ({n},) on {x.device}, got {tuple(bias.shape)} on {bias.device}")


def linear(x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W^T (+ bias)`` for ``x`` of shape ``[..., K]``, on the backend the weight was prepared for.

    Eager, it runs the weight's launch plan for this M directly; traced (``torch.compile``, export, fake or subclass
    tensors) it is one ``mxgemm::linear`` op, whose implementation runs the same plan. Gradients flow to ``x`` (and
    ``bias``) as through ``x @ W^T + bias`` with ``W`` the dequantized weight; the weight itself takes none. A call
    whose plan C++ can run goes straight to it (:mod:`mxgemm.fastcall`)."""
    if not torch.compiler.is_compiling():
        fast = getattr(weight, "fast", None)
        if fast is not None:
            y = fast(x, bias)
            if y is not None:
                return y
    if not isinstance(weight, PreparedWeight) or isinstance(weight, PreparedGroupedWeight):
        raise TypeError(_not_dense(weight))
    check_inputs(x, weight.in_features, weight.out_features, weight.device, bias)
    grad = wants_grad(x, bias)
    if not grad and x.numel() and _untraced(x, bias):
        return run_planned(x, weight, bias)  # any leading dimensions: a plan takes them as they are
    if not grad:
        return op_linear(x, weight.traced_args(), weight.out_features, bias)
    return _on_rows(x, weight.out_features, lambda rows: _Linear.apply(rows, bias, weight))


def _not_dense(weight: object) -> str:
    """Why ``weight`` is not what :func:`linear` takes, and what to do."""
    if isinstance(weight, PreparedGroupedWeight):
        hint = "; an experts' grouped weight runs through mxgemm.grouped_linear or mxgemm.moe_experts"
    elif isinstance(weight, MXTensor):
        hint = "; prepare it once with mxgemm.prepare_weight(t.qdata, t.scale)"
    else:
        hint = ""
    return f"weight must be a PreparedWeight (mxgemm.prepare_weight), got {type(weight).__name__}{hint}"


def op_linear(x: torch.Tensor, op: dict, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [..., K] (checked) through one ``mxgemm::linear`` op on its [M, K] rows, for the weight [n, K] whose op
    arguments ``op`` holds (:meth:`PreparedWeight.traced_args`): what a traced call leaves in the graph."""
    tensors = list(op["tensors"].values())
    return _on_rows(x, n, lambda rows: linear_op(rows, tensors, bias, op["backend"], op["meta"]))


def op_linear_gated(gate: torch.Tensor, up: torch.Tensor, op: dict, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(gate) * up`` ([..., K] each, checked) through one ``mxgemm::linear_gated`` op on their [M, K] rows, as
    :func:`op_linear`."""
    tensors = list(op["tensors"].values())
    return _on_rows(
        gate, n, lambda rows: linear_gated_op(rows, up.reshape(rows.shape), tensors, bias, op["backend"], op["meta"])
    )


def _on_rows(x: torch.Tensor, n: int, run) -> torch.Tensor:
    """``run`` on ``x``'s [M, K] rows, its [M, n] answer shaped after ``x``'s leading dimensions (none for no rows)."""
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    y = rows.new_empty((0, n)) if rows.shape[0] == 0 else run(rows)
    return y if flat else y.reshape(*x.shape[:-1], n)


def wants_grad(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))


def _untraced(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Plain tensors, and nothing tracing the call: it may run the plan without the op."""
    plain = type(x) is torch.Tensor and (bias is None or type(bias) is torch.Tensor)
    return plain and not torch.compiler.is_compiling()


class _Linear(torch.autograd.Function):
    """The op with the gradient of ``x @ W^T + bias`` for the dequantized ``W`` (a frozen weight): what training
    through an MXFP8 layer needs, an adapter's or the input's."""

    @staticmethod
    def forward(x: torch.Tensor, bias: torch.Tensor | None, weight: PreparedWeight) -> torch.Tensor:
        return linear_op(x, weight.op_tensors, bias, weight.backend, weight.op_meta)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.weight = inputs[2]

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = dequantize(MXTensor(*get_backend(ctx.weight.backend).export_mx(ctx.weight)), grad_y.dtype)
            grad_x = grad_y @ w
        if ctx.needs_input_grad[1]:
            grad_bias = grad_y.sum(0)
        return grad_x, grad_bias, None
