"""Mixture-of-experts blocks whose eager decode calls replay one CUDA graph: the router and the experts together.

A decode step's sparse MoE block (transformers' ``Qwen3MoeSparseMoeBlock``, ``MixtralSparseMoeBlock``, ...) runs its
router in bf16 (a linear layer, a softmax, a top-k, a division: each a launch and its Python) and then the experts.
:class:`mxgemm.MXFP8Experts` already replays its own launches as a graph; the router's launches cost the host about
as much again. A block holding an :class:`~mxgemm.moe.MXFP8Experts` as ``experts`` and called on one tensor
(``forward(hidden_states)``) is taken as gated MLPs are (:mod:`mxgemm.gated`): its class becomes a subclass of its
own, of the same name, whose eager calls of up to :data:`mxgemm.moe.GRAPHED_TOKENS` rows replay a graph of the whole
block (:class:`mxgemm.graphs.EagerGraphs`): the same launches on the same bytes, so the same bits, for a fraction of
their host time. Parameters, buffers and the state dict stay as they were; the router stays in bf16.

A graph bakes in what the block's Python read when it was captured, so each call's signature holds the block's state:
every module's attributes (``top_k``, ``training``, ...: plain values by value, other objects by identity), its
parameters' and buffers' storage, its children. Changing any of them captures anew (mxgemm's layers number the
prepared weights they hold, so that new weights whose objects reuse freed ones' ids still do); a change inside an
object a module holds (a field of a config it reads when called) is not seen. A forward that changes that state itself
(keeps its router logits, counts its calls) would see it change only once, when captured: such a block runs directly
from then on, and says so in the log.
Calls run the block's own forward where a graph could not stand in for it: traced calls, more rows, gradients asked
for, hooks on a module inside the block or on every module, ``MXGEMM_EAGER_GRAPHS=0``, and the cases of
:func:`mxgemm.graphs.graphable`.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn

from . import tuning
from .graphs import EagerGraphs, graphable
from .moe import GRAPHED_TOKENS, MXFP8Experts
from .taken import hooked_inside, same_name_subclass

__all__ = ["GRAPHED_BLOCK", "graph_moe_blocks", "is_graphed_block"]

logger = logging.getLogger("mxgemm")

GRAPHED_BLOCK = f": router and experts replayed as one CUDA graph in eager calls of up to {GRAPHED_TOKENS} tokens"
NOT_GRAPHED = ": not graphed ("

_GRAPHS = "_mxgemm_block_graphs"  # the block's EagerGraphs in its __dict__; None once its forward proved stateful


_PLAIN = (int, float, bool, str, type(None))


def _state(block: nn.Module) -> tuple:
    """What a graph of ``block``'s call was made from: each module's attribute values (plain ones by value, others by
    identity), its parameters' and buffers' storage and its children."""
    out = []
    for module in block.modules():
        out.append(tuple([v if type(v) in _PLAIN else id(v) for v in module.__dict__.values()]))
        out.append(
            tuple([0 if t is None else t.data_ptr() for t in (*module._parameters.values(), *module._buffers.values())])
        )
        out.append(tuple(map(id, module._modules.values())))
    return tuple(out)


def _graphed_call(block: nn.Module, own_forward, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """``block``'s call from its graphs, or None where it runs its own forward."""
    graphs = block.__dict__.get(_GRAPHS)
    if graphs is None or not isinstance(hidden_states, torch.Tensor):
        return None
    if hidden_states.dim() == 0 or hidden_states.numel() > GRAPHED_TOKENS * hidden_states.shape[-1]:
        return None
    if not graphable(hidden_states) or hooked_inside(block):
        return None
    if torch.is_grad_enabled() and any(p.requires_grad for p in block.parameters()):
        return None
    state = _state(block)
    changed = []

    def run(x: torch.Tensor) -> torch.Tensor:
        y = own_forward(block, x)
        if _state(block) != state:
            changed.append(True)
        return y

    y = graphs(run, hidden_states, key=(tuning.generation(), state))
    if changed:  # its Python changed the block: a replay would not
        block.__dict__[_GRAPHS] = None
        logger.info("mxgemm: %s changes its own state when called: its eager calls run without a graph", type(block))
    return y


def _unfit_reason(block: nn.Module) -> str:
    """Why ``block`` is not taken ("" where it is): its forward must take the hidden states alone."""
    params = list(inspect.signature(type(block).forward).parameters.values())[1:]
    if len(params) != 1 or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return "its forward takes more than the hidden states"
    return ""


@functools.cache
def _graphed_class(cls: type) -> type:
    own_forward = cls.forward

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # traced: the block's own steps, nothing of this module's state read
            return own_forward(self, hidden_states)
        y = _graphed_call(self, own_forward, hidden_states)
        return own_forward(self, hidden_states) if y is None else y

    return same_name_subclass(cls, _graphed_class, (cls,), {"forward": forward, "_mxgemm_graphed_block": True})


def is_graphed_block(module: nn.Module) -> bool:
    """Whether :func:`graph_moe_blocks` took this module."""
    return getattr(type(module), "_mxgemm_graphed_block", False)


def graph_moe_blocks(model: nn.Module) -> list[str]:
    """Make each MoE block of ``model`` holding an :class:`~mxgemm.moe.MXFP8Experts` as ``experts`` replay its eager
    decode calls as one CUDA graph (module docstring), in place. Returns what it did, a line a block
    (``"model.layers.0.mlp: router and experts replayed as one CUDA graph ..."``, or ``"...: not graphed (why)"``)."""
    done = []
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "experts", None), MXFP8Experts) or is_graphed_block(module):
            continue
        reason = _unfit_reason(module)
        if reason:
            done.append(f"{name}{NOT_GRAPHED}{reason})")
            continue
        module.__class__ = _graphed_class(type(module))
        module.__dict__[_GRAPHS] = EagerGraphs()
        done.append(name + GRAPHED_BLOCK)
    return done
