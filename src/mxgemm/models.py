"""Whole models: replace ``nn.Linear`` layers with ``MXFP8Linear``, and the experts of mixture-of-experts layers with
``MXFP8Experts``, in place, and say what happened to each."""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .errors import BackendUnavailableError
from .format import BLOCK_SIZE, ScaleMode
from .fusion import GROUPS, tally
from .fusion import fuse as fuse_model
from .gated import GATED
from .linear import MXFP8Linear
from .moe import MXFP8Experts, experts_modules, experts_stay_in_bf16, experts_unfit_reason
from .moe_blocks import GRAPHED_BLOCK
from .resolve import check_request, resolve_backend

logger = logging.getLogger("mxgemm")

__all__ = [
    "LayerReport",
    "QuantizeReport",
    "hf_meta_model",
    "linear_shapes",
    "matches_skip",
    "quantizable_linears",
    "quantize_model",
    "router_names",
    "skip_reason",
]


@dataclass(frozen=True)
class LayerReport:
    name: str
    replaced: bool
    backend: str | None  # the backend the layer got, when replaced
    recipe: str | None
    reason: str  # why it was skipped, or "" when replaced
    kind: str = "linear"  # "linear" (an nn.Linear) or "experts" (the 3-D experts of a mixture-of-experts layer)


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
            key = f"{r.backend} ({r.recipe})" + ("" if r.kind == "linear" else f", {_KINDS[r.kind]}")
            by_backend[key] = by_backend.get(key, 0) + 1
        counts = []
        for kind in dict.fromkeys(["linear", *(r.kind for r in self.layers)]):
            of_kind = [r for r in self.layers if r.kind == kind]
            if of_kind or kind == "linear":
                counts.append(f"{sum(r.replaced for r in of_kind)} of {len(of_kind)} {_KINDS[kind]}")
        lines = ["replaced " + ", ".join(counts)]
        lines += [f"  {n} on {b}" for b, n in by_backend.items()]
        lines += [f"  skipped {r.name}: {r.reason}" for r in self.skipped]
        counted = tally(self.fusion)
        if counted.fused:
            lines.append(f"  {counted.fused} groups of layers sharing an input (q/k/v, gate/up) run as one")
        lines += [f"  {n} of those groups: {what}" for what, n in counted.regimes.items()]
        lines += [f"  {n} groups not fused: {why}" for why, n in counted.kept.items()]
        if counted.gated:
            lines.append(f"  {counted.gated} gated MLPs{GATED}")
        if counted.graphed:
            lines.append(f"  {counted.graphed} MoE blocks{GRAPHED_BLOCK}")
        lines += [f"  {n} MoE blocks not graphed: {why}" for why, n in counted.ungraphed.items()]
        return "\n".join(lines)


_KINDS = {"linear": "linear layers", "experts": "experts modules (mixture of experts)"}


def matches_skip(name: str, patterns: str | Sequence[str]) -> bool:
    """Whether ``name`` (or its last component) matches one of the glob ``patterns`` (one string is one pattern)."""
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
    experts: bool = True,
    atomic: bool = False,
) -> QuantizeReport:
    """Replace every ``nn.Linear`` of ``model`` by an ``MXFP8Linear`` quantized online, and every experts module of
    a mixture of experts (transformers' 3-D ``gate_up_proj`` / ``down_proj`` experts) by an ``MXFP8Experts``, in
    place.

    ``skip``: names or glob patterns, matched against the full module name and its last component. Layers whose
    ``in_features`` is not a multiple of 32, routers (the linear layers of a module that holds ``experts``) and
    experts modules :class:`MXFP8Experts` cannot take stay as they are; the report says which and why, per kind. A
    named ``backend`` that cannot run raises for the first layer it cannot take, as everywhere in mxgemm.
    ``fuse``: then make each layer's q, k and v projections, and its gate and up projections, run as one, and its
    gated MLP hand ``down_proj`` the product quantized in one kernel, and its MoE blocks replay their router and
    experts as one CUDA graph in eager decode calls (:func:`mxgemm.fusion.fuse`). ``experts``: False
    leaves every experts module as it is (the report says so).

    Every request is checked before the model changes, and weights on the meta device (layers accelerate offloaded,
    or never loaded) are refused then, naming the first. By default each layer then frees its full-precision weight as
    its replacement goes in, so the model never holds both copies of more than one layer; a failure partway (out of
    memory, a kernel's error) leaves the layers before it replaced, and the error says so. ``atomic``: build every
    replacement first and put them in only once all are built, so that a failure leaves the model as it was, at the
    cost of holding the full-precision and the quantized weights together until then (about 1.5x bf16's bytes).
    """
    reports = []
    routers = router_names(model)
    _check_every_layer_resolves(model, backend, scale_mode, recipe, skip, routers)
    experts_plan = _experts_plan(model, backend, recipe, skip if experts else ("*",))
    pending: dict[str, nn.Module] = {}  # atomic: the replacements, put in once all are built
    put = pending.__setitem__ if atomic else model.set_submodule
    # names, not modules: each nn.Linear (and its bf16 weight) is freed as soon as its replacement is in place
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    for name in names:
        module = model.get_submodule(name)
        reason = skip_reason(name, module, skip, routers)
        if reason:
            reports.append(LayerReport(name, False, None, None, reason))
            continue
        with _stops_partway(name, reports, atomic):
            layer = MXFP8Linear.from_linear(module, backend=backend, scale_mode=scale_mode, recipe=recipe)
        del module
        put(name, layer)
        reports.append(LayerReport(name, True, layer.backend, layer.recipe, ""))
    reports += _quantize_experts(
        model, experts_plan, backend, scale_mode, recipe, put=put, earlier=reports, atomic=atomic
    )
    for name, module in pending.items():
        model.set_submodule(name, module)
    replaced = [r for r in reports if r.replaced]
    if backend is None and replaced and all(r.backend == "emulation" for r in replaced):
        logger.warning(
            "mxgemm: every quantized layer runs on the emulation backend (plain torch, fp32): the reference, several "
            "times slower than bf16; no faster backend runs here (`mxgemm info` says why)"
        )
    return QuantizeReport(tuple(reports), tuple(fuse_model(model)) if fuse else ())


@contextlib.contextmanager
def _stops_partway(name: str, reports: list[LayerReport], atomic: bool):
    """A failure converting ``name`` after the request was checked (out of memory, a kernel's error): unless
    ``atomic`` (nothing put in yet), the layers already replaced stay replaced (their full-precision weights are freed
    as each is), so the error says where it stopped and that the model is partly converted, on the error itself
    (Python 3.11+) and on the ``mxgemm`` logger."""
    try:
        yield
    except Exception as exc:
        done = 0 if atomic else sum(r.replaced for r in reports)
        if done:
            message = (
                f"quantize_model stopped at {name}: the {done} layers before it are already quantized and the model is "
                "partly converted; load it again before retrying"
            )
            logger.error("mxgemm: %s (%s)", message, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            if hasattr(exc, "add_note"):
                exc.add_note(message)
        raise


def _check_every_layer_resolves(model: nn.Module, backend, scale_mode, recipe, skip, routers) -> None:
    """Raise, before the model changes, what converting any linear layer would raise for its request: an unknown
    scale mode, recipe or backend, a named backend that cannot run a layer's shape on its device, or a weight on the
    meta device (:func:`_check_loaded`)."""
    check_request(None, None, scale_mode)
    for name, module in model.named_modules():
        if type(module) is nn.Linear and not skip_reason(name, module, skip, routers):
            shape = (module.out_features, module.in_features)
            resolve_backend(backend, device=module.weight.device, recipe=recipe, shape=shape)
            _check_loaded(name, module.weight)


def _check_loaded(name: str, *weights: torch.Tensor) -> None:
    """Raise where a weight to quantize holds no data: on the meta device, as accelerate leaves offloaded layers."""
    if any(w.is_meta for w in weights):
        raise ValueError(
            f"{name} has its weights on the meta device (offloaded by accelerate, or never loaded): quantize_model "
            "quantizes weights in memory; load the model without offloading, or convert its folder with "
            "`mxgemm quantize` and load that"
        )


def _experts_plan(model: nn.Module, backend, recipe, skip) -> dict[str, str]:
    """Each experts module of ``model`` (not yet an :class:`MXFP8Experts`) -> why it stays as it is, or "" where it
    is replaced: matched by ``skip``, unfit (:func:`experts_unfit_reason`), a named backend that does not run
    grouped weights, or ``auto`` on a GPU where no backend but the emulation does (the emulated experts would run
    many times slower than bf16's). Decided before the model changes."""
    plan = {}
    for name, module in experts_modules(model):
        reason = "matches skip" if matches_skip(name, skip) else experts_unfit_reason(module)
        device = module.gate_up_proj.device
        if not reason:
            _check_loaded(name, module.gate_up_proj, module.down_proj)
            try:
                resolve_backend(backend, device=device, recipe=recipe, grouped=True)
            except BackendUnavailableError as exc:
                reason = f"{exc.backend}: {exc.reason}"
            else:
                reason = experts_stay_in_bf16(device, backend, recipe)
        plan[name] = reason
    return plan


def _quantize_experts(
    model: nn.Module,
    plan: dict[str, str],
    backend,
    scale_mode,
    recipe,
    *,
    put,
    earlier: list[LayerReport],
    atomic: bool,
) -> list[LayerReport]:
    """Each experts module of ``plan`` replaced by an :class:`MXFP8Experts` (``put(name, module)``), or left with its
    reason; ``earlier``: the linear layers' reports (a failure partway counts them as already replaced)."""
    reports = []
    for name, reason in plan.items():
        if reason:
            reports.append(LayerReport(name, False, None, None, reason, kind="experts"))
            continue
        module = model.get_submodule(name)
        with _stops_partway(name, [*earlier, *reports], atomic):
            experts = MXFP8Experts.from_experts(module, backend=backend, scale_mode=scale_mode, recipe=recipe)
        del module
        put(name, experts)
        reports.append(LayerReport(name, True, experts.backend, experts.recipe, "", kind="experts"))
    return reports


def router_names(model: nn.Module) -> frozenset[str]:
    """The linear layers that route a mixture of experts: those a module holding ``experts`` holds itself (``gate``,
    ``shared_expert_gate``), which stay in full precision."""
    return frozenset(
        f"{owner}.{child}" if owner else child
        for owner, module in model.named_modules()
        if isinstance(getattr(module, "experts", None), nn.Module)
        for child, sub in module.named_children()
        if type(sub) is nn.Linear
    )


def skip_reason(name: str, module: nn.Linear, skip: Sequence[str], routers: frozenset[str] = frozenset()) -> str:
    """Why :func:`quantize_model` (and ``mxgemm quantize``) leave a linear layer as it is, or "" when they quantize
    it: its name matches ``skip``, it routes a mixture of experts (``routers``: :func:`router_names`), or its
    ``in_features`` is not a multiple of 32."""
    if matches_skip(name, skip):
        return "matches skip"
    if name in routers:
        return "routes a mixture of experts (kept in full precision)"
    if module.in_features % BLOCK_SIZE:
        return f"in_features={module.in_features} is not a multiple of {BLOCK_SIZE}"
    return ""


def quantizable_linears(model: nn.Module, skip: Sequence[str]) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers of ``model`` that :func:`quantize_model` replaces (none of :func:`skip_reason`'s),
    with their names."""
    routers = router_names(model)
    return [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and not skip_reason(n, m, skip, routers)]


def hf_meta_model(config) -> nn.Module:
    """A transformers model of ``config`` built on the meta device (no memory, no weights), of the class its
    checkpoints are written by: the class ``config.architectures`` names where transformers has it
    (``Qwen3VLMoeForConditionalGeneration``, whose text model's tensors are under ``model.language_model``), else
    ``AutoModelForCausalLM`` for a causal LM, else ``AutoModel``."""
    import transformers

    named = [getattr(transformers, a, None) for a in (config.architectures or []) if isinstance(a, str)]
    named = [c for c in named if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)]
    with torch.device("meta"):
        if named:
            return named[0](config)
        causal = any(str(a).endswith("ForCausalLM") for a in (config.architectures or []))
        return (transformers.AutoModelForCausalLM if causal else transformers.AutoModel).from_config(config)


def linear_shapes(model: nn.Module, *, skip: Sequence[str] = ("lm_head",)) -> list[tuple[int, int, str]]:
    """The distinct ``(out_features, in_features)`` of the ``nn.Linear`` layers :func:`quantize_model` would
    replace, then of the groups of them that read one input (:data:`mxgemm.fusion.GROUPS`: q/k/v, gate/up), whose
    joined weight runs the calls up to the device's ``shared_input_max_rows`` (:mod:`mxgemm.thresholds`) rows; each
    with the name of its first layer (or group): what ``mxgemm tune --model-dir`` tunes. Works on a model built on
    the meta device."""
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
