"""``torch.library`` custom ops in the ``mxgemm`` namespace, with fake (meta) implementations.

The GEMM runs as one opaque op, ``mxgemm::linear``, so ``torch.compile(fullgraph=True)`` traces models with
``MXFP8Linear`` layers without graph breaks and never looks inside a backend; the fake implementations give exact
output shapes, dtypes and strides. A prepared weight crosses the op boundary as its list of tensors plus one JSON
string (:meth:`PreparedWeight.op_meta`: tensor names, shape, recipe, run-time flags).
"""

from __future__ import annotations

import json

import torch
from torch import Tensor

from .backends import PreparedWeight, get_backend
from .block128 import padded_1x128_shape
from .format import BLOCK_SIZE, quantize

__all__ = ["linear_op", "quantize_1x128_op", "quantize_mx_op"]


@torch.library.custom_op("mxgemm::linear", mutates_args=())
def linear_op(x: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str, meta: str) -> Tensor:
    """``x`` [M, K] -> [M, N] in ``x.dtype`` on ``backend``, for the prepared weight described by (tensors, meta)."""
    from .autotune import tactic_for_call

    weight = PreparedWeight.from_op_args(backend, tensors, meta)
    b = get_backend(backend)
    return b.run(x, weight, bias, tactic=tactic_for_call(b, weight, x))


@linear_op.register_fake
def _(x: Tensor, tensors: list[Tensor], bias: Tensor | None, backend: str, meta: str) -> Tensor:
    return x.new_empty((x.shape[0], json.loads(meta)["out_features"]))


@torch.library.custom_op("mxgemm::quantize_mx", mutates_args=())
def quantize_mx_op(x: Tensor, scale_mode: str, elem_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`mxgemm.quantize` as an op: (float8 data shaped like ``x``, uint8 scales [..., K/32])."""
    t = quantize(x, scale_mode=scale_mode, elem_dtype=elem_dtype)
    return t.qdata, t.scale


@quantize_mx_op.register_fake
def _(x: Tensor, scale_mode: str, elem_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=elem_dtype), x.new_empty(
        (*x.shape[:-1], x.shape[-1] // BLOCK_SIZE), dtype=torch.uint8
    )


@torch.library.custom_op("mxgemm::quantize_1x128", mutates_args=())
def quantize_1x128_op(x: Tensor) -> tuple[Tensor, Tensor]:
    """The Triton 1x128 activation quantizer: (float8_e4m3fn [Mp, Kp], fp32 scales [Mp, Kp/128] strides (1, Mp))."""
    from .kernels.act_quant import quantize_1x128_padded

    return quantize_1x128_padded(x)


@quantize_1x128_op.register_fake
def _(x: Tensor) -> tuple[Tensor, Tensor]:
    mp, kp = padded_1x128_shape(*x.shape)
    q = x.new_empty((mp, kp), dtype=torch.float8_e4m3fn)
    return q, x.new_empty_strided((mp, kp // 128), (1, mp), dtype=torch.float32)
