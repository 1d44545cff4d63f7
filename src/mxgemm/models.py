"""Whole models: replace ``nn.Linear`` layers with ``MXFP8Linear`` in place and say what happened to each."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .format import BLOCK_SIZE, ScaleMode
from .linear import MXFP8Linear

__all__ = ["LayerReport", "QuantizeReport", "linear_shapes", "quantize_model"]


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
        return "\n".join(lines)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


def quantize_model(
    model: nn.Module,
    *,
    backend: str | None = None,
    scale_mode: ScaleMode = "floor",
    recipe: str | None = None,
    skip: Sequence[str] = ("lm_head",),
) -> QuantizeReport:
    """Replace every ``nn.Linear`` of ``model`` by an ``MXFP8Linear`` quantized online, in place.

    ``skip``: names or glob patterns, matched against the full module name and its last component. Layers whose
    ``in_features`` is not a multiple of 32 stay as they are; the report says so. A named ``backend`` that cannot
    run raises for the first layer it cannot take, as everywhere in mxgemm.
    """
    reports = []
    # names, not modules: each nn.Linear (and its bf16 weight) is freed as soon as its replacement is in place
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in names:
        module = model.get_submodule(name)
        if _matches(name, skip):
            reports.append(LayerReport(name, False, None, None, "matches skip"))
            continue
        if module.in_features % BLOCK_SIZE:
            reason = f"in_features={module.in_features} is not a multiple of {BLOCK_SIZE}"
            reports.append(LayerReport(name, False, None, None, reason))
            continue
        layer = MXFP8Linear.from_linear(module, backend=backend, scale_mode=scale_mode, recipe=recipe)
        parent_name, _, child = name.rpartition(".")
        del module
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
        reports.append(LayerReport(name, True, layer.backend, layer.recipe, ""))
    return QuantizeReport(tuple(reports))


def linear_shapes(model: nn.Module, *, skip: Sequence[str] = ("lm_head",)) -> list[tuple[int, int, str]]:
    """The distinct ``(out_features, in_features)`` of the ``nn.Linear`` layers :func:`quantize_model` would
    replace, each with the name of its first layer: what ``mxgemm tune --model-dir`` tunes. Works on a model built
    on the meta device."""
    shapes: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear and not _matches(name, skip) and module.in_features % BLOCK_SIZE == 0:
            shapes.setdefault((module.out_features, module.in_features), name)
    return [(n, k, name) for (n, k), name in shapes.items()]
