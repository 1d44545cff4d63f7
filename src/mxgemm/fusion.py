"""Linear layers that read the same input, run as one: a transformer layer's q, k and v projections, its gate and up
projections (Hugging Face's names, which Llama, Mistral, Qwen and most decoder models share).

The members' prepared weights become row views of one prepared weight (one copy on the device, as before). A call
of a member on an input runs the whole weight once and keeps the other members' outputs (views of its output) until
each takes its own, called on the same, unchanged tensor; traced (``torch.compile``), the same steps
(``MXFP8Linear._traced_group_output``, on plain values each member holds) leave one ``mxgemm::linear`` op per group in
the graph and no state behind. Eager inputs of more rows than the device's threshold
(:class:`mxgemm.thresholds.Thresholds`: ``shared_input_max_rows``, ``joined_max_rows`` for q/k/v groups and the gate/up
group of a gated MLP, :func:`fuse`) run each member's own GEMM (contiguous outputs), on the input quantized
once, by the first member's call, for the members called on it in turn where the backend quantizes activations apart
from its GEMM (``SharesQuantizedInput.run_sharing``: ``hybrid_sm90``'s cuBLAS path, ``emulation``). Everything else
runs the member alone on its view: fp32 inputs, traced inputs above the threshold, a member called on
another input (the group then stops running as one: the layers do not share their input), or a member whose bias was
replaced or that was re-prepared.

Each member's output is the same recipe on the same weight bits as its own call: below ``hybrid-block128``'s
crossover exactly the same, from it the quantized GEMM's accumulation order may differ, as between any two tactics.
The crossover is the joined weight's (``JoinsRows.joined_info``), which each member's view takes: where the recipe's
rule gives the larger weight a lower one, the members quantize their activations from there, and the account of
:func:`fuse_shared_inputs` says so.
One call launches one GEMM (and one activation quantizer) where it launched two or three: less host time in eager
calls, fewer kernels in a CUDA graph, and the small k and v projections run inside a GEMM that fills the GPU.
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from . import thresholds
from .attention import vouch_attention
from .backends import PreparedWeight, get_backend
from .backends.capabilities import JoinsRows, SharesQuantizedInput
from .gated import GATED, fuse_gated_mlps, is_gated
from .linear import MXFP8Linear
from .moe_blocks import GRAPHED_BLOCK, NOT_GRAPHED, graph_moe_blocks
from .ops import call_tactic, run_planned
from .weights import linear, wants_grad

__all__ = ["GROUPS", "SharedInput", "Tally", "fuse", "fuse_shared_inputs", "tally", "unfit_reason"]

logger = logging.getLogger("mxgemm")

GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedInput:
    """The one prepared weight of a group of :class:`MXFP8Linear` layers and the outputs its last call left for the
    members that have not taken theirs. Members reach it through ``layer.shared`` ((group, index)); it holds no
    reference to them."""

    def __init__(
        self,
        weight: PreparedWeight,
        sizes: Sequence[int],
        bias: torch.Tensor | None,
        bias_views: Sequence[torch.Tensor | None],
    ):
        self.weight = weight
        self.sizes = list(sizes)
        self.bias = bias
        self.bias_views = tuple(bias_views)
        self.enabled = True
        self._max_rows: int | None = None
        # what each member's traced call reads, a plain dict the member holds (MXFP8Linear._traced)
        self.traced = [
            {
                **weight.traced_args(),
                "on": True,
                "key": id(self),
                "start": sum(self.sizes[:i]),
                "rows": sum(self.sizes),
                "members": len(self.sizes),
                "max_rows": self.default_rows(),
                "bias": bias,
                "bias_view": self.bias_views[i],
            }
            for i in range(len(self.sizes))
        ]
        self._x: torch.Tensor | None = None
        self._version = -1
        self._grad = False  # the grad mode the pending outputs were made in
        # an inference tensor the caller calls every member on in turn, running nothing else in between (a gated MLP's
        # forward: gated._joined_call)
        self.trusted: torch.Tensor | None = None
        self._pending: dict[int, torch.Tensor] = {}
        # above the threshold: (weak input, its version, its quantized rows, the members still to call on them)
        self._quantized: tuple | None = None
        self.members: list[PreparedWeight] = []  # each member's row view of the weight, set by _group

    @property
    def max_rows(self) -> int | None:
        """Calls of more rows run each member's own GEMM: eager ones read it (None: :meth:`default_rows`) at each call,
        traced ones take it (or the default) as it was set, so compiled and eager calls run the same GEMMs."""
        return self._max_rows

    def default_rows(self) -> int:
        """The rows up to which a group runs as one where nothing set :attr:`max_rows`: the weight's device's
        ``shared_input_max_rows``."""
        return thresholds.for_device(self.weight.device).shared_input_max_rows

    @max_rows.setter
    def max_rows(self, rows: int | None) -> None:
        self._max_rows = rows
        for traced in self.traced:
            traced["max_rows"] = rows or self.default_rows()

    def output(self, index: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Member ``index``'s output for ``x`` (its ``bias`` as it holds it now) in an eager call, or None where it
        runs alone."""
        if bias is not self.bias_views[index]:
            self.disable("a member's bias was replaced")
            return None
        # eager calls only (traced ones take MXFP8Linear._traced_group_output). Inference tensors keep no version
        # counter, so a change in place between the members' calls could not be seen: each member runs alone, unless
        # its caller vouches for the tensor (`trusted`)
        if x.is_inference():
            if x is not self.trusted:
                return None
            version = -1
        else:
            version = x._version
        grad = torch.is_grad_enabled()
        if x is self._x and version == self._version and grad != self._grad:
            self._x, self._pending = None, {}  # made in the other grad mode: they would drop or keep gradients wrongly
        if x is self._x and version == self._version:
            y = self._pending.pop(index, None)
            if y is None:  # it took its output for this input already
                return None
            if not self._pending:
                self._x = None
            return y
        if self._pending:  # a member asked for another input while others had not taken theirs
            self.disable("its members were called on different inputs")
            return None
        if x.numel() > (self._max_rows or self.default_rows()) * x.shape[-1]:
            return self._own_gemm(index, x, bias, version)
        # split_with_sizes: Tensor.split's Python wrapper costs 1.4 µs more on a CPU host
        ys = linear(x, self.weight, self.bias).split_with_sizes(self.sizes, -1)
        self._x, self._version, self._grad = x, version, grad
        self._pending = {i: y for i, y in enumerate(ys) if i != index}
        return ys[index]

    def _own_gemm(self, index: int, x: torch.Tensor, bias: torch.Tensor | None, version: int) -> torch.Tensor | None:
        """Above the group's threshold: member ``index``'s own GEMM. The first member called on a tensor runs its own
        call and keeps the input's quantized rows that call made (:meth:`SharesQuantizedInput.run_sharing`); the
        others, called on the same unchanged tensor in turn, run their GEMMs on those rows. None where the member runs
        its own call."""
        if type(x) is not torch.Tensor or wants_grad(x, bias):
            return None
        backend = get_backend(self.weight.backend)
        if not isinstance(backend, SharesQuantizedInput):
            return None
        rows = x.reshape(-1, x.shape[-1])
        held = self._quantized
        member = self.members[index]
        tactic = call_tactic(member, rows)  # the member's own call: the shared rows give its bits
        if held is None or held[0]() is not x or held[1] != version or index not in held[3]:
            shared = backend.run_sharing(rows, member, bias, tactic)
            if shared is None:
                return None
            y, quantized = shared
            held = (weakref.ref(x), version, quantized, set(range(len(self.sizes))) - {index})
        else:
            held[3].discard(index)
            y = backend.run_quantized(rows, held[2], member, bias, tactic)
            if y is None:  # the member's call reads no such rows: it runs alone
                y = run_planned(rows, member, bias)
        self._quantized = held if held[3] else None  # dropped once every member has taken its output
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def disable(self, why: str) -> None:
        """From now on each member runs alone on its view (the weight stays one copy)."""
        if self.enabled and not torch.compiler.is_compiling():  # no logging inside a traced graph
            logger.info("mxgemm: layers sharing an input run one by one from now on: %s", why)
        self.enabled = False
        self._x, self._pending, self._quantized = None, {}, None
        for traced in self.traced:
            traced["on"] = False


def unfit_reason(members: Sequence[MXFP8Linear]) -> str:
    """Why these layers cannot run as one, or "" when they can: the same input size, backend, recipe and device, a
    backend layout that splits by rows without padding, run-time info the backend can join
    (:meth:`JoinsRows.joined_info`), biases on all or none, none of them in a group that still runs as one."""
    first = members[0].prepared
    backend = get_backend(first.backend)
    layout = backend.row_layout(first) if isinstance(backend, JoinsRows) else None
    if layout is None:
        return f"{first.backend}'s prepared weights do not split by rows"
    for m in members:
        w = m.prepared
        if m.shared is not None and m.shared[0].enabled:  # a switched-off group's members may group again
            return "already in a group"
        if (w.backend, w.recipe, w.in_features, w.device) != (
            first.backend,
            first.recipe,
            first.in_features,
            first.device,
        ):
            return "backend, recipe, input size or device differ"
        if set(w.tensors) != set(layout):
            return "prepared tensors differ from the backend's row layout"
        for name, rows in layout.items():
            t, t0 = w.tensors[name], first.tensors[name]
            if w.out_features % rows or t.shape[0] * rows != w.out_features:
                return f"out_features={w.out_features} is not a whole number of {name}'s {rows}-row groups"
            if t.shape[1:] != t0.shape[1:] or t.dtype != t0.dtype:
                return f"{name} differs in columns or dtype"
        b0 = members[0].bias
        if (m.bias is None) != (b0 is None) or (b0 is not None and m.bias.dtype != b0.dtype):
            return "biases on some layers only, or of different dtypes"
    try:
        backend.joined_info([m.prepared for m in members], sum(m.out_features for m in members))
    except ValueError as exc:
        return str(exc)
    return ""


def _group(members: Sequence[MXFP8Linear]) -> SharedInput:
    first = members[0].prepared
    backend = get_backend(first.backend)
    layout = backend.row_layout(first)
    tensors = {name: torch.cat([m.prepared.tensors[name] for m in members]) for name in layout}
    sizes = [m.out_features for m in members]
    # each member keeps its own exactness report, and takes the rest (the joined weight's crossover) from the group
    info = backend.joined_info([m.prepared for m in members], sum(sizes))
    weight = PreparedWeight(first.backend, first.recipe, sum(sizes), first.in_features, tensors, info)
    bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
    group = SharedInput(weight, sizes, bias, [None] * len(sizes) if bias is None else bias.split(sizes))
    start = 0
    for index, (m, n) in enumerate(zip(members, sizes, strict=True)):
        views = {name: tensors[name][start // rows : (start + n) // rows] for name, rows in layout.items()}
        group.members.append(
            PreparedWeight(first.backend, first.recipe, n, first.in_features, views, {**m.prepared.info, **info})
        )
        m.share(group.members[-1], group.bias_views[index], (group, index), group.traced[index])
        start += n
    return group


def fuse_shared_inputs(model: nn.Module, groups: Sequence[Sequence[str]] = GROUPS) -> list[str]:
    """Make the :class:`MXFP8Linear` children of each module named as one of ``groups`` (e.g. ``q_proj``, ``k_proj``,
    ``v_proj``) run as one, in place. Returns what it did: each group made (``"model.layers.0.self_attn: q_proj,
    k_proj, v_proj"``), and each left as it was with the reason (``"...: not fused (reason)"``)."""
    done = []
    for name, module in model.named_modules():
        for names in groups:
            members = [getattr(module, n, None) for n in names]
            if not all(isinstance(m, MXFP8Linear) for m in members):
                continue
            where = f"{name}: {', '.join(names)}"
            reason = unfit_reason(members)
            if reason:
                done.append(f"{where}{_NOT_FUSED}{reason})")
                continue
            alone = sorted({m.prepared.info.get("crossover") for m in members}, key=str)
            joined = _group(members).weight.info.get("crossover")
            note = f"{_REGIME}{joined}, the crossover of their joined weight; alone: {' or '.join(map(str, alone))})"
            done.append(where if alone == [joined] else where + note)
    return done


def fuse(model: nn.Module) -> list[str]:
    """mxgemm's fusions of ``model``'s layers, in place: those that read the same input run as one
    (:func:`fuse_shared_inputs`), then gated MLPs hand ``down_proj`` their product quantized in one kernel
    (:func:`mxgemm.gated.fuse_gated_mlps`); q/k/v groups and gated MLPs' gate/up groups run as one up to their
    device's ``joined_max_rows``, under ``inference_mode`` too where an attention module hands its input only to its
    q/k/v projections (:func:`mxgemm.attention.vouch_attention`); MoE blocks replay their router and experts as one
    CUDA graph in eager decode calls (:func:`mxgemm.moe_blocks.graph_moe_blocks`). Their accounts, one after the
    other."""
    account = fuse_shared_inputs(model) + fuse_gated_mlps(model) + graph_moe_blocks(model)
    vouch_attention(model)
    for module in model.modules():
        for layer in (getattr(module, "q_proj", None), module.gate_proj if is_gated(module) else None):
            if isinstance(layer, MXFP8Linear) and layer.shared is not None:
                group = layer.shared[0]
                group.max_rows = thresholds.for_device(group.weight.device).joined_max_rows
    return account


_NOT_FUSED = ": not fused ("
_QUANTIZED_FROM = "activations quantized from M = "
_REGIME = f" ({_QUANTIZED_FROM}"


class Tally(NamedTuple):
    """:func:`fuse`'s account counted."""

    fused: int  # groups run as one
    kept: Counter[str]  # groups left as they were, by reason
    regimes: Counter[str]  # groups made whose crossover is not their members', by what it is
    gated: int  # gated MLPs taken
    graphed: int  # MoE blocks replayed as one graph
    ungraphed: Counter[str]  # MoE blocks left as they were, by reason


def tally(account: Sequence[str]) -> Tally:
    """:func:`fuse`'s account counted."""
    gated = sum(line.endswith(GATED) for line in account)
    graphed = sum(line.endswith(GRAPHED_BLOCK) for line in account)
    ungraphed = Counter(line.rsplit(NOT_GRAPHED, 1)[1][:-1] for line in account if NOT_GRAPHED in line)
    kept = Counter(line.rsplit(_NOT_FUSED, 1)[1][:-1] for line in account if _NOT_FUSED in line)
    regimes = Counter(
        _QUANTIZED_FROM + line.rsplit(_REGIME, 1)[1][:-1]
        for line in account
        if _REGIME in line and _NOT_FUSED not in line
    )
    fused = len(account) - sum(kept.values()) - gated - graphed - sum(ungraphed.values())
    return Tally(fused, kept, regimes, gated, graphed, ungraphed)
