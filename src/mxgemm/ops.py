"""The ``mxgemm`` ops (``torch.library``), with fake (meta) implementations, and the planned call they share with
eager calls.

The GEMM runs as one opaque op, ``mxgemm::linear``, so ``torch.compile(fullgraph=True)`` traces models with
``MXFP8Linear`` layers without graph breaks and never looks inside a backend; the fake implementations give exact
output shapes, dtypes and strides. A prepared weight crosses the op boundary as its list of tensors plus one JSON
string (:meth:`PreparedWeight.op_meta`: tensor names, shape, recipe, run-time flags); the implementation finds the
live weight those tensors belong to and runs its launch plan for the call's M, as an eager call does
(:func:`run_planned`).

The ops are defined with ``torch.library.Library`` and one implementation for every device key: the dispatcher calls
it directly, where a ``torch.library.custom_op`` goes through a Python autograd layer first (several µs of host time
a call, which a compiled graph without CUDA graphs pays on every layer). They compute no gradients:
``mxgemm.linear`` wraps the op in an autograd function when one is asked for.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

from . import autotune, fastcall, tuning
from .backends import PreparedGroupedWeight, PreparedWeight, get_backend
from .backends.capabilities import GatedInput
from .block128 import padded_1x128_shape
from .format import BLOCK_SIZE, quantize

__all__ = [
    "call_tactic",
    "grouped_linear_op",
    "linear_gated_op",
    "linear_op",
    "moe_experts_op",
    "quantize_1x128_op",
    "quantize_mx_op",
    "run_gated",
    "run_planned",
]

_LIB = torch.library.Library("mxgemm", "DEF")


def _define(schema: str, impl, fake):
    """Define ``mxgemm::<name>`` from its schema, with ``impl`` for every device and ``fake`` for fake and meta
    tensors; returns the op (its overload)."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"mxgemm::{name}", fake, lib=_LIB)
    return getattr(torch.ops.mxgemm, name).default


def run_planned(x: Tensor, weight: PreparedWeight, bias: Tensor | None) -> Tensor:
    """Run ``x`` [M, K] (or [..., K], its leading dimensions M rows; the output [..., N]) through the weight's plan
    for (M, dtype), made on first use with the call's tactic (:func:`call_tactic`); a plan is remade when tuning
    changes the cache. A plan C++ can call joins the
    weight's table of them (:mod:`mxgemm.fastcall`), which later eager calls of that M take first. A strided
    ``bias`` is copied contiguous first: kernels that add it in their epilogue read it at unit stride."""
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    m = x.shape[0] if x.dim() == 2 else x.numel() // weight.in_features
    key = (m, x.dtype, tuning.generation())
    plan = weight.plans.launch.get(key)
    if plan is None:
        plan = weight.cached("launch", key, lambda: _plan(x, weight, m))
        fastcall.register(weight, m, x.dtype, plan)
    return plan(x, bias)


def _plan(x: Tensor, weight: PreparedWeight, m: int):
    rows = x.reshape(m, weight.in_features)
    return get_backend(weight.backend).plan(weight, m, x.dtype, call_tactic(weight, rows))


def call_tactic(weight: PreparedWeight, x: Tensor) -> Any:
    """The tactic of ``weight``'s call on ``x``'s M rows ([M, K]): the tuner's (:func:`mxgemm.autotune.tactic_for_call`,
    which reads ``MXGEMM_AUTOTUNE`` then), None for the backend's default. Resolved once per M, dtype and tuning
    generation, and handed to every route of that call (its plan, the rows it shares with weights of the same input,
    its gated product), so that they give its bits."""
    backend = get_backend(weight.backend)
    if not backend.tunable:
        return None
    key = (x.shape[0], x.dtype, tuning.generation())
    return weight.cached("tactics", key, lambda: (autotune.tactic_for_call(backend, weight, x),))[0]


def run_gated(gate: Tensor, up: Tensor, weight: PreparedWeight, bias: Tensor | None) -> Tensor | None:
    """``weight``'s call on ``silu(gate) * up`` ([M, K] each), the product quantized by one kernel with the GEMM's
    input, through the route the backend plans for the call's tactic (:meth:`GatedInput.gated_plan`), made once per M,
    dtype and tuning generation, kept with the weight's plans and given to its C++ table; None for rows strided along
    K, or where the backend plans no route (the caller then computes the product)."""
    if gate.stride(1) != 1 or up.stride(1) != 1:
        return None
    m = gate.shape[0]
    key = (m, gate.dtype, tuning.generation())
    route = weight.plans.gated.get(key)
    if route is None:
        backend = get_backend(weight.backend)
        if not isinstance(backend, GatedInput):
            return None
        route = weight.cached(
            "gated", key, lambda: backend.gated_plan(weight, m, gate.dtype, call_tactic(weight, gate)) or False
        )
        fastcall.register(weight, m, gate.dtype, route)
    return route(gate, up, bias) if route else None


def _linear(x: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str, meta: str) -> Tensor:
    return run_planned(x, PreparedWeight.from_op_args(backend, tensors, meta), bias)


def _linear_fake(x: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str, meta: str) -> Tensor:
    return x.new_empty((x.shape[0], json.loads(meta)["out_features"]))


linear_op = _define(
    "linear(Tensor x, Tensor[] tensors, Tensor? bias, str backend, str meta) -> Tensor", _linear, _linear_fake
)
"""``mxgemm::linear``: ``x`` [M, K] -> [M, N] in ``x.dtype`` on ``backend``, for the prepared weight described by
(tensors, meta)."""


def _linear_gated(
    gate: Tensor, up: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str, meta: str
) -> Tensor:
    weight = PreparedWeight.from_op_args(backend, tensors, meta)
    bias = None if bias is None else bias.contiguous()  # as run_planned: kernels read it at unit stride
    y = run_gated(gate, up, weight, bias)
    return run_planned(torch.nn.functional.silu(gate) * up, weight, bias) if y is None else y


def _linear_gated_fake(
    gate: Tensor, up: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str, meta: str
) -> Tensor:
    return gate.new_empty((gate.shape[0], json.loads(meta)["out_features"]))


linear_gated_op = _define(
    "linear_gated(Tensor gate, Tensor up, Tensor[] tensors, Tensor? bias, str backend, str meta) -> Tensor",
    _linear_gated,
    _linear_gated_fake,
)
"""``mxgemm::linear_gated``: ``mxgemm::linear`` on ``silu(gate) * up`` as PyTorch computes it in their dtype (gate and
up [M, K]), the product made by one kernel with the GEMM's input where the backend plans it (:func:`run_gated`),
else computed first: the same bits either way."""


def _grouped_linear(x: Tensor, offsets: Tensor, tensors: list[Tensor], backend: str, meta: str) -> Tensor:
    weight = PreparedGroupedWeight.from_op_args(backend, tensors, meta)
    b = get_backend(backend)
    return b.run_grouped(x, weight, offsets, autotune.tactic_for_grouped_call(b, weight, x.shape[0], x))


def _grouped_linear_fake(x: Tensor, offsets: Tensor, tensors: list[Tensor], backend: str, meta: str) -> Tensor:
    return x.new_empty((x.shape[0], json.loads(meta)["out_features"]))


grouped_linear_op = _define(
    "grouped_linear(Tensor x, Tensor offsets, Tensor[] tensors, str backend, str meta) -> Tensor",
    _grouped_linear,
    _grouped_linear_fake,
)
"""``mxgemm::grouped_linear``: ``x`` [S, K], rows sorted by expert, through the grouped weight described by
(tensors, meta): row ``i`` times expert ``e``'s weight where ``offsets[e-1] <= i < offsets[e]`` -> [S, N] in
``x.dtype`` (zeros past ``offsets[-1]``); no host synchronisation, one shape whatever the routing."""


def _moe_experts(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up: list[Tensor],
    down: list[Tensor],
    backend: str,
    gate_up_meta: str,
    down_meta: str,
) -> Tensor:
    tokens, k = topk_ids.shape
    if tokens == 0 or k == 0:  # no copy routed: no launch (a backend's plan takes at least one)
        return x.new_zeros((tokens, json.loads(down_meta)["out_features"]))
    up = PreparedGroupedWeight.from_op_args(backend, gate_up, gate_up_meta)
    dn = PreparedGroupedWeight.from_op_args(backend, down, down_meta)
    # the plan of this shape, dtype, tuning generation and down projection, with gate/up's plans
    key = (tokens, k, x.dtype, tuning.generation(), down_meta)
    plan = up.plans.experts.get(key)
    if plan is None:
        b = get_backend(backend)
        tactics = autotune.tactics_for_experts_call(b, up, dn, tokens, k, x)
        plan = up.cached("experts", key, lambda: b.plan_experts(up, dn, tokens, k, x.dtype, tactics))
    return plan(x, topk_ids, topk_weights, up, dn)


def _moe_experts_fake(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up: list[Tensor],
    down: list[Tensor],
    backend: str,
    gate_up_meta: str,
    down_meta: str,
) -> Tensor:
    return x.new_empty((x.shape[0], json.loads(down_meta)["out_features"]))


moe_experts_op = _define(
    "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor[] gate_up, Tensor[] down, str backend, "
    "str gate_up_meta, str down_meta) -> Tensor",
    _moe_experts,
    _moe_experts_fake,
)
"""``mxgemm::moe_experts``: the routed block of a mixture of experts on one backend's grouped weights (described by
their tensors and meta), ``x`` [T, H] -> [T, H] (:meth:`mxgemm.backends.capabilities.GroupedWeights.run_experts`);
no host synchronisation, one shape whatever the routing."""


def _quantize_mx(x: Tensor, scale_mode: str, elem_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    t = quantize(x, scale_mode=scale_mode, elem_dtype=elem_dtype)
    return t.qdata, t.scale


def _quantize_mx_fake(x: Tensor, scale_mode: str, elem_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=elem_dtype), x.new_empty(
        (*x.shape[:-1], x.shape[-1] // BLOCK_SIZE), dtype=torch.uint8
    )


quantize_mx_op = _define(
    "quantize_mx(Tensor x, str scale_mode, ScalarType elem_dtype) -> (Tensor, Tensor)", _quantize_mx, _quantize_mx_fake
)
"""``mxgemm::quantize_mx``: :func:`mxgemm.quantize` as an op: (float8 data shaped like ``x``, uint8 scales
[..., K/32])."""


def _quantize_1x128(x: Tensor) -> tuple[Tensor, Tensor]:
    from .kernels.act_quant import quantize_1x128_padded

    return quantize_1x128_padded(x)


def _quantize_1x128_fake(x: Tensor) -> tuple[Tensor, Tensor]:
    mp, kp = padded_1x128_shape(*x.shape)
    q = x.new_empty((mp, kp), dtype=torch.float8_e4m3fn)
    return q, x.new_empty_strided((mp, kp // 128), (1, mp), dtype=torch.float32)


quantize_1x128_op = _define("quantize_1x128(Tensor x) -> (Tensor, Tensor)", _quantize_1x128, _quantize_1x128_fake)
"""``mxgemm::quantize_1x128``: the Triton 1x128 activation quantizer: (float8_e4m3fn [Mp, Kp], fp32 scales
[Mp, Kp/128] strides (1, Mp))."""
