"""Whole models: replace ``nn.Linear`` layers with ``MXFP8Linear`` in place and say what happened to each."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .format import BLOCK_SIZE, ScaleMode
from .fusion import GROUPS, tally
from .fusion import fuse as fuse_model
from .gated import GATED
from .linear import MXFP8Linear

__all__ = [
    "LayerReport",
    "QuantizeReport",
    "hf_model_class",
    "linear_shapes",
    "quantizable_linears",
    "quantize_model",
    "skip_reason",
]


@dataclass(frozen=True)
class LayerReport:
    name: str
    replaced: bool
    backend: str | None  # the backend the layer got, when replaced
    recipe: str | None
    reason: str  # why it was skipped, or "" when replaced


@dataclass(frozen=True)
class QuantizeReport:
    layers: tuple[LayerReport, ...]
    fusion: tuple[str, ...] = ()  # :func:`mxgemm.fusion.fuse`'s account, one line a group or gated MLP

    @property
    def replaced(self) -> list[LayerReport]:
        return [r for r in self.layers if r.replaced]

    @property
    def skipped(self) -> list[LayerReport]:
        return [r for r in self.layers if not r.replaced]

    def __str__(self) -> str:
        by_backend: dict[str, int] = {}
        for r in self.replaced:
            by_backend[f"{r.backend} ({r.recipe})"] = by_backend.get(f"{r.backend} ({r.recipe})", 0) + 1
        lines = [f"replaced {len(self.replaced)} of {len(self.layers)} linear layers"]
        lines += [f"  {n} on {b}" for b, n in by_backend.items()]
        lines += [f"  skipped {r.name}: {r.reason}" for r in self.skipped]
        fused, kept, regimes, gated = tally(self.fusion)
        if fused:
            lines.append(f"  {fused} groups of layers sharing an input (q/k/v, gate/up) run as one")
        lines += [f"  {n} of those groups: {what}" for what, n in regimes.items()]
        lines += [f"  {n} groups not fused: {why}" for why, n in kept.items()]
        if gated:
            lines.append(f"  {gated} gated MLPs{GATED}")
        return "\n".join(lines)


def _matches(name: str, patterns: str | Sequence[str]) -> bool:
    if isinstance(patterns, str):  # skip="lm_head" is one pattern, not seven letters
        patterns = (patterns,)
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


def quantize_model(
    model: nn.Module,
    *,
    backend: str | None = None,
    scale_mode: ScaleMode = "floor",
    recipe: str | None = None,
    skip: Sequence[str] = ("lm_head",),
    fuse: bool = True,
) -> QuantizeReport:
    """Replace every ``nn.Linear`` of ``model`` by an ``MXFP8Linear`` quantized online, in place.

    ``skip``: names or glob patterns, matched against the full module name and its last component. Layers whose
    ``in_features`` is not a multiple of 32 stay as they are; the report says so. A named ``backend`` that cannot
    run raises for the first layer it cannot take, as everywhere in mxgemm. ``fuse``: then make each layer's q, k
    and v projections, and its gate and up projections, run as one, and its gated MLP hand ``down_proj`` the
    product quantized in one kernel (:func:`mxgemm.fusion.fuse`).
    """
    reports = []
    # names, not modules: each nn.Linear (and its bf16 weight) is freed as soon as its replacement is in place
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in names:
        module = model.get_submodule(name)
        reason = skip_reason(name, module, skip)
        if reason:
            reports.append(LayerReport(name, False, None, None, reason))
            continue
        layer = MXFP8Linear.from_linear(module, backend=backend, scale_mode=scale_mode, recipe=recipe)
        del module
        model.set_submodule(name, layer)
        reports.append(LayerReport(name, True, layer.backend, layer.recipe, ""))
    return QuantizeReport(tuple(reports), tuple(fuse_model(model)) if fuse else ())


def skip_reason(name: str, module: nn.Linear, skip: Sequence[str]) -> str:
    """Why :func:`quantize_model` (and ``mxgemm quantize``) leave a linear layer as it is, or "" when they quantize
    it: its name matches ``skip``, or its ``in_features`` is not a multiple of 32."""
    if _matches(name, skip):
        return "matches skip"
    if module.in_features % BLOCK_SIZE:
        return f"in_features={module.in_features} is not a multiple of {BLOCK_SIZE}"
    return ""


def quantizable_linears(model: nn.Module, skip: Sequence[str]) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers of ``model`` that :func:`quantize_model` replaces (none of :func:`skip_reason`'s),
    with their names."""
    return [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and not skip_reason(n, m, skip)]


def hf_model_class(config):
    """The transformers auto class a model of ``config`` is built with: ``AutoModelForCausalLM`` for a causal LM,
    else ``AutoModel``."""
    from transformers import AutoModel, AutoModelForCausalLM

    causal = any(a.endswith("ForCausalLM") for a in (config.architectures or []))
    return AutoModelForCausalLM if causal else AutoModel


def linear_shapes(model: nn.Module, *, skip: Sequence[str] = ("lm_head",)) -> list[tuple[int, int, str]]:
    """The distinct ``(out_features, in_features)`` of the ``nn.Linear`` layers :func:`quantize_model` would
    replace, then of the groups of them that read one input (:data:`mxgemm.fusion.GROUPS`: q/k/v, gate/up), whose
    joined weight runs the calls up to ``fusion.MAX_ROWS`` rows; each with the name of its first layer (or group):
    what ``mxgemm tune --model-dir`` tunes. Works on a model built on the meta device."""
    layers = dict(quantizable_linears(model, skip))
    shapes: dict[tuple[int, int], str] = {}
    for name, module in layers.items():
        shapes.setdefault((module.out_features, module.in_features), name)
    for parent, _ in model.named_modules():
        for names in GROUPS:
            members = [layers.get(f"{parent}.{n}" if parent else n) for n in names]
            if all(members) and len({m.in_features for m in members}) == 1:
                where = f"{parent}: {', '.join(names)}" if parent else ", ".join(names)
                shapes.setdefault((sum(m.out_features for m in members), members[0].in_features), where)
    return [(n, k, name) for (n, k), name in shapes.items()]
