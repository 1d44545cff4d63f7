"""Gated MLPs, ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` with SiLU (Hugging Face's Llama, Mistral, Qwen and most
decoder models), whose product reaches ``down_proj`` quantized by one kernel.

Where ``down_proj`` quantizes its input (:func:`mxgemm.ops.run_gated`: ``hybrid_sm90`` from its crossover, on cuBLASLt's
path and on our FP8 kernel's), one kernel reads the gate and up projections' outputs and writes the 1x128-quantized
product ``down_proj``'s GEMM reads, where the model runs SiLU, the product and ``down_proj``'s quantizer as three
kernels (the product written in bf16 and read back twice): the same bits (:meth:`MXFP8Linear.on_gated`). Elsewhere
(rows the backend does not quantize, traced calls, gradients, hooks on ``act_fn`` or ``down_proj`` or on every module,
an ``act_fn`` no longer SiLU or a ``down_proj`` no longer an ``MXFP8Linear``: each call checks) the model's own steps
run.

A module is taken where its class's ``forward`` is that expression (its bytecode the same as :func:`_written_so`'s or
:func:`_returned_so`'s), ``act_fn`` is SiLU, the three projections are :class:`MXFP8Linear` and ``down_proj``'s backend
runs the product's kernel (:class:`mxgemm.backends.capabilities.GatedInput`: at some M; a report claims nothing that
does not run). Its class becomes a
subclass of its own, of the same name, with that forward (its repr says so); parameters, buffers and state dict stay
as they were.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .linear import MXFP8Linear
from .taken import global_hooks, hooked, same_name_subclass

__all__ = ["GATED", "fuse_gated_mlps", "is_gated"]

GATED = ": act_fn(gate_proj) * up_proj quantized for down_proj in one kernel"


def _written_so(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _returned_so(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


_FORMS = {(f.__code__.co_code, f.__code__.co_names) for f in (_written_so, _returned_so)}


def _is_silu(module: nn.Module) -> bool:
    cls = type(module)
    return cls is nn.SiLU or (cls.__name__ == "SiLUActivation" and cls.__module__ == "transformers.activations")


def _gated_mlp(module: nn.Module) -> bool:
    code = getattr(type(module).forward, "__code__", None)
    layers = (getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
    return (
        code is not None
        and (code.co_code, code.co_names) in _FORMS
        and _is_silu(getattr(module, "act_fn", None))
        and all(isinstance(layer, MXFP8Linear) for layer in layers)
        and module.down_proj._gated_from is not None  # its backend runs the product's kernel at some M
    )


def _joined_call(gate_proj: nn.Module, up_proj: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_proj(x), up_proj(x)``. Under ``inference_mode`` their group (:class:`mxgemm.fusion.SharedInput`) runs as
    one only where it is told that nothing runs between the two calls: so where they are one group of two, neither
    hooked (a hook could change ``x`` in place) nor every module."""
    group = getattr(gate_proj, "shared", None)
    if (
        group is None
        or torch.compiler.is_compiling()
        or not x.is_inference()
        or getattr(up_proj, "shared", None) is None
        or up_proj.shared[0] is not group[0]
        or len(group[0].sizes) != 2
        or hooked(gate_proj)
        or hooked(up_proj)
        or global_hooks()
    ):
        return gate_proj(x), up_proj(x)
    group[0].trusted = x
    try:
        return gate_proj(x), up_proj(x)
    finally:
        group[0].trusted = None


@functools.cache
def _gated_class(cls: type) -> type:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _joined_call(self.gate_proj, self.up_proj, x)
        down, act = self.down_proj, self.act_fn
        if not (_is_silu(act) and isinstance(down, MXFP8Linear)) or hooked(down) or hooked(act) or global_hooks():
            y = None  # the module changed since it was taken, or hooks would miss the steps: the model's own steps
        elif torch.compiler.is_compiling():
            y = down.traced_gated(gate, up)
        else:
            y = down.on_gated(gate, up)
        return down(act(gate) * up) if y is None else y

    def extra_repr(self) -> str:
        return ", ".join(filter(None, (cls.extra_repr(self), "product quantized for down_proj in one kernel")))

    namespace = {"forward": forward, "extra_repr": extra_repr, "_mxgemm_gated": True}
    return same_name_subclass(cls, _gated_class, (cls,), namespace)


def is_gated(module: nn.Module) -> bool:
    """Whether :func:`fuse_gated_mlps` took this module."""
    return getattr(type(module), "_mxgemm_gated", False)


def fuse_gated_mlps(model: nn.Module) -> list[str]:
    """Make each gated MLP of ``model`` (module docstring) hand ``down_proj`` its product quantized by one kernel, in
    place. Returns what it did, a line a module (``"model.layers.0.mlp: act_fn(gate_proj) * up_proj quantized for
    down_proj in one kernel"``)."""
    done = []
    for name, module in model.named_modules():
        if _gated_mlp(module):
            module.__class__ = _gated_class(type(module))
            done.append(name + GATED)
    return done
