"""Attention modules whose q, k and v projections run as one under ``torch.inference_mode`` too.

A group of layers that read one input (:class:`mxgemm.fusion.SharedInput`) runs as one only where it can tell that
the input did not change between its members' calls: by the tensor's version counter, which inference tensors lack,
so under ``inference_mode`` each member runs alone unless its caller vouches for the input (``trusted``), as a gated
MLP's forward does for gate and up (:mod:`mxgemm.gated`). An attention module is taken where its class's forward
(its source, read once a class and checked against the code that runs) hands its input to nothing but
``self.q_proj``, ``self.k_proj`` and ``self.v_proj``, each called on it alone, reads nothing of it but ``.shape`` and
never rebinds it, and its three projections are one group: its class becomes a subclass of its own, of the same
name, whose calls vouch for the input while no hook could run between the projections' calls (none on a module
inside it, none on every module). Transformers' Llama, Qwen, Mistral and Qwen3-MoE attentions are of that form. The
same GEMM runs as in ``no_grad`` calls: one launch of the quantizer and one of the GEMM for the three, where they
launched three of each.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types

import torch
from torch import nn

from .linear import MXFP8Linear
from .taken import hooked_inside, same_name_subclass

__all__ = ["PROJECTIONS", "is_vouched_attention", "vouch_attention"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_NAMESPACE_READERS = {"locals", "vars", "eval", "exec", "globals"}


@functools.cache
def _input_name(cls: type) -> str | None:
    """The name of the input ``cls.forward`` hands only to its q, k and v projections (module docstring), or None."""
    fn = inspect.unwrap(cls.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef) or not _same_code(tree, fn.__code__):
        return None
    params = [*func.args.posonlyargs, *func.args.args]
    if len(params) < 2:
        return None
    name = params[1].arg
    parents = {child: node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _NAMESPACE_READERS:
            return None
        if isinstance(node, ast.arg) and node.arg == name and node is not params[1]:
            return None  # a nested function or lambda's own argument of that name
        if not (isinstance(node, ast.Name) and node.id == name):
            continue
        parent = parents.get(node)
        if isinstance(node.ctx, ast.Load) and isinstance(parent, ast.Attribute) and parent.attr == "shape":
            continue
        if isinstance(node.ctx, ast.Load) and _projection_call(parent, node):
            continue
        return None
    return name


def _same_code(tree: ast.Module, code: types.CodeType) -> bool:
    """Whether the source read (``tree``) is that of the code that runs (the names it reads and its variables): a
    file changed since the module was imported reads as some other function."""
    compiled = compile(tree, "<forward>", "exec")
    made = next((c for c in compiled.co_consts if isinstance(c, types.CodeType)), None)
    return made is not None and (made.co_names, made.co_varnames) == (code.co_names, code.co_varnames)


def _projection_call(call, arg: ast.Name) -> bool:
    """Whether ``call`` is ``self.<q|k|v>_proj(arg)``."""
    return (
        isinstance(call, ast.Call)
        and call.args == [arg]
        and not call.keywords
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in PROJECTIONS
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "self"
    )


def _group(module: nn.Module):
    """The enabled group of ``module``'s q, k and v projections, or None."""
    layers = [getattr(module, n, None) for n in PROJECTIONS]
    if not all(isinstance(layer, MXFP8Linear) and layer.shared is not None for layer in layers):
        return None
    group = layers[0].shared[0]
    if not group.enabled or len(group.sizes) != 3 or any(layer.shared[0] is not group for layer in layers):
        return None
    return group


@functools.cache
def _vouched_class(cls: type, name: str) -> type:
    own_forward = cls.forward

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # traced: the module's own steps (traced groups keep no state)
            return own_forward(self, *args, **kwargs)
        x = args[0] if args else kwargs.get(name)
        group = _group(self) if isinstance(x, torch.Tensor) and x.is_inference() else None
        if group is None or hooked_inside(self):
            return own_forward(self, *args, **kwargs)
        group.trusted = x
        try:
            return own_forward(self, *args, **kwargs)
        finally:
            group.trusted = None

    return same_name_subclass(cls, _vouched_class, (cls, name), {"forward": forward, "_mxgemm_vouched": True})


def is_vouched_attention(module: nn.Module) -> bool:
    """Whether :func:`vouch_attention` took this module."""
    return getattr(type(module), "_mxgemm_vouched", False)


def vouch_attention(model: nn.Module) -> list[str]:
    """Take each attention module of ``model`` whose q/k/v group runs as one and whose forward hands its input only to
    those projections (module docstring), in place. Returns the modules taken, by name."""
    done = []
    for name, module in model.named_modules():
        if is_vouched_attention(module) or _group(module) is None:
            continue
        arg = _input_name(type(module))
        if arg is not None:
            module.__class__ = _vouched_class(type(module), arg)
            done.append(name)
    return done
