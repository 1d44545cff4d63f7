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

import torch
from torch import Tensor

from . import autotune, fastcall
from .backends import PreparedWeight, get_backend
from .block128 import padded_1x128_shape
from .format import BLOCK_SIZE, quantize

__all__ = ["linear_gated_op", "linear_op", "quantize_1x128_op", "quantize_mx_op", "run_planned"]

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
    for (M, dtype), made on first use with the tactic the tuner gives (:func:`mxgemm.autotune.tactic_for_call`, which
    reads ``MXGEMM_AUTOTUNE`` then); a plan is remade when tuning changes the cache. A plan C++ can call joins the
    weight's table of them (:mod:`mxgemm.fastcall`), which later eager calls of that M take first."""
    m = x.shape[0] if x.dim() == 2 else x.numel() // weight.in_features
    key = (m, x.dtype, autotune.generation())
    plan = weight.plans.get(key)
    if plan is None:
        plan = weight.cached(key, lambda: _plan(x, weight, m))
        fastcall.register(weight, m, x.dtype, plan)
    return plan(x, bias)


def _plan(x: Tensor, weight: PreparedWeight, m: int):
    backend = get_backend(weight.backend)
    rows = x.reshape(m, weight.in_features)
    return backend.plan(weight, m, x.dtype, autotune.tactic_for_call(backend, weight, rows))


def _linear(x: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str, meta: str) -> Tensor:
    return run_planned(x, PreparedWeight.from_op_args(backend, tensors, meta), bias)


def _linear_fake(x: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str, meta: str) -> Tensor:
    return x.new_empty((x.shape[0], json.loads(meta)["out_features"]))


linear_op = _define("linear(Tensor x, Tensor[] tensors, Tensor? bias, str backend, str meta) -> Tensor", _linear,
                    _linear_fake)  # fmt: skip
"""``mxgemm::linear``: ``x`` [M, K] -> [M, N] in ``x.dtype`` on ``backend``, for the prepared weight described by
(tensors, meta)."""


def _linear_gated(gate: Tensor, up: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str,
                  meta: str) -> Tensor:  # fmt: skip
    weight = PreparedWeight.from_op_args(backend, tensors, meta)
    y = get_backend(backend).run_gated(gate, up, weight, bias)
    return run_planned(torch.nn.functional.silu(gate) * up, weight, bias) if y is None else y


def _linear_gated_fake(gate: Tensor, up: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str,
                       meta: str) -> Tensor:  # fmt: skip
    return gate.new_empty((gate.shape[0], json.loads(meta)["out_features"]))


linear_gated_op = _define("linear_gated(Tensor gate, Tensor up, Tensor[] tensors, Tensor? bias, str backend, str meta) "
                          "-> Tensor", _linear_gated, _linear_gated_fake)  # fmt: skip
"""``mxgemm::linear_gated``: ``mxgemm::linear`` on ``silu(gate) * up`` as PyTorch computes it in their dtype (gate and
up [M, K]), the product made by one kernel with the GEMM's input where the backend runs it (:meth:`Backend.run_gated`),
else computed first: the same bits either way."""


def _quantize_mx(x: Tensor, scale_mode: str, elem_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    t = quantize(x, scale_mode=scale_mode, elem_dtype=elem_dtype)
    return t.qdata, t.scale


def _quantize_mx_fake(x: Tensor, scale_mode: str, elem_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=elem_dtype), x.new_empty(
        (*x.shape[:-1], x.shape[-1] // BLOCK_SIZE), dtype=torch.uint8
    )


quantize_mx_op = _define("quantize_mx(Tensor x, str scale_mode, ScalarType elem_dtype) -> (Tensor, Tensor)",
                         _quantize_mx, _quantize_mx_fake)  # fmt: skip
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
