"""What every backend provides: a capability check with a reason, a recipe, weight preparation, a run and its plan,
tactics, and the MX tensors of a prepared weight. What only some backends offer is a capability of its own
(:mod:`mxgemm.backends.capabilities`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import operator
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .. import settings
from ..availability import Availability
from ..device import DeviceInfo
from ..recipes import RECIPES, Recipe

__all__ = [
    "RECIPES",
    "Availability",
    "Backend",
    "PlanCache",
    "PreparedGroupedWeight",
    "PreparedWeight",
    "Recipe",
    "Tactic",
    "UnsupportedWeightError",
    "check_reencoding",
    "recorded_as",
    "tactic_json",
]


@dataclass(frozen=True)
class Tactic:
    """A tunable backend's choice for one problem: a kernel path (the backend's own enum) and, where the path takes
    one, the kernel's launch config (a frozen dataclass of its binding, with its own ``valid``)."""

    path: str
    config: Any = None

    def json(self) -> dict[str, Any]:
        """How a tuning file records it."""
        out: dict[str, Any] = {"path": str(self.path)}
        if self.config is not None:
            out["config"] = {"kind": type(self.config).__name__, **dataclasses.asdict(self.config)}
        return out


def tactic_json(tactic: Any) -> Any:
    """A tactic as a tuning file records it: :meth:`Tactic.json`, or the tactic itself (already JSON)."""
    return tactic.json() if isinstance(tactic, Tactic) else tactic


def recorded_as(tactic: Any, recorded: Any) -> bool:
    """Whether a tuning file's ``recorded`` tactic is ``tactic``: the same JSON, where a field of the config that the
    record lacks counts as its default (a field added to a config later keeps the launch it had without it)."""
    now = tactic_json(tactic)
    if now == recorded:
        return True
    config = getattr(tactic, "config", None)
    if not (
        dataclasses.is_dataclass(config) and isinstance(recorded, dict) and isinstance(recorded.get("config"), dict)
    ):
        return False
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.default is not dataclasses.MISSING}
    return now == {**recorded, "config": {**defaults, **recorded["config"]}}


class UnsupportedWeightError(Exception):
    """Raised by ``Backend.prepare`` when this particular weight's values rule the backend out (the message says
    why). An explicit request then fails with that reason; ``auto`` moves on to the next backend."""


def check_reencoding(qdata: torch.Tensor, prepare: Callable[[], tuple[dict, dict]]) -> tuple[dict, dict]:
    """``prepare()``'s (tensors, info) of a re-encoding to 128x128 blocks of the weight ``qdata``; refused
    (:class:`UnsupportedWeightError`) where ``qdata`` is not E4M3 or the re-encoding (its ``info["reencode"]``
    report) would change it by more than ``MXGEMM_REENCODE_MAX_ERROR``."""
    if qdata.dtype != torch.float8_e4m3fn:
        raise UnsupportedWeightError(f"re-encodes E4M3 weights only; got {qdata.dtype}")
    tensors, info = prepare()
    report, limit = info["reencode"], settings.reencode_max_error()
    if report.rel_error > limit:
        raise UnsupportedWeightError(
            f"re-encoding to 128x128 blocks would change this weight by {report.rel_error:.3g} (relative), above "
            f"MXGEMM_REENCODE_MAX_ERROR={limit:g} ({report})"
        )
    return tensors, info


_FP8 = {str(d): d for d in (torch.float8_e4m3fn, torch.float8_e5m2)}
MAX_PLANS = 256  # entries a prepared weight's PlanCache keeps, all kinds together (PreparedWeight.cached)


@dataclass
class PlanCache:
    """What a prepared weight's calls work out once and keep, each kind in a table of its own:

    - ``launch``: the plans eager and compiled calls run (:meth:`Backend.plan`), by (M, activation dtype, tuning
      generation);
    - ``tactics``: each call's tactic (:func:`mxgemm.ops.call_tactic`), held as a 1-tuple, by the same key;
    - ``gated``: the routes that take a gated MLP's product (:meth:`GatedInput.gated_plan`, False where none), by the
      same key;
    - ``shared``: a backend's plans of the rows it shares with weights of the same input, by (M, activation dtype);
    - ``experts``: a grouped gate/up weight's plans of the routed block (``GroupedWeights.plan_experts``), by (tokens,
      top-k, activation dtype, tuning generation, the down projection's meta).
    """

    launch: dict[tuple, Callable] = field(default_factory=dict)
    tactics: dict[tuple, tuple] = field(default_factory=dict)
    gated: dict[tuple, Any] = field(default_factory=dict)
    shared: dict[tuple, Any] = field(default_factory=dict)
    experts: dict[tuple, Callable] = field(default_factory=dict)

    def tables(self) -> tuple[dict, ...]:
        return (self.launch, self.tactics, self.gated, self.shared, self.experts)

    def __len__(self) -> int:
        return sum(map(len, self.tables()))

    def clear(self) -> None:
        for table in self.tables():
            table.clear()


def any_rows(plan: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]):
    """A plan of ``x`` [M, K] as one of [..., K] (:meth:`Backend.plan`): other leading dimensions flattened into M
    rows, and restored on the output."""

    def call(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dim() == 2:
            return plan(x, bias)
        return plan(x.reshape(-1, x.shape[-1]), bias).reshape(*x.shape[:-1], -1)

    return call


def run_time_info(weight: PreparedWeight) -> dict[str, Any]:
    """A prepared weight's info less its re-encoding report (``"reencode"``, the one entry about this weight's values
    rather than how it runs): what weights joined into one (:meth:`JoinsRows.joined_info`) must agree on."""
    return {k: v for k, v in weight.info.items() if k != "reencode"}


# Prepared weights by the id of their first op tensor: the op's implementation finds the weight whose very tensors it
# is given, and so its launch plans. Weak: a dropped weight leaves (and its tensors, and so the id, go with it).
_LIVE: weakref.WeakValueDictionary[int, PreparedWeight] = weakref.WeakValueDictionary()


@functools.lru_cache(maxsize=4096)
def _parse_meta(meta: str) -> dict[str, Any]:
    return json.loads(meta)


@dataclass(frozen=True)
class PreparedWeight:
    """A weight prepared once for one backend: whatever layout, padding or re-encoding that backend runs from.

    ``op_tensors`` and ``op_meta`` are how it crosses the ``mxgemm::linear`` op boundary, computed once: the tensors
    (fp8 ones as uint8 views, which every op supports) and one JSON string with everything else the run needs.
    """

    backend: str
    recipe: str
    out_features: int
    in_features: int
    tensors: dict[str, torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)
    op_tensors: list[torch.Tensor] | None = field(default=None, repr=False, compare=False)
    op_meta: str | None = field(default=None, repr=False, compare=False)
    # what its calls work out once, by kind (launch plans, tactics, gated routes, shared rows)
    plans: PlanCache = field(default_factory=PlanCache, repr=False, compare=False)
    # the plans C++ calls, by M (mxgemm.fastcall): made with the first of them, emptied with ``plans``
    fast: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_device", next(iter(self.tensors.values())).device)  # read on every call
        if self.op_meta is not None:  # rebuilt from op arguments: nothing to compute
            return
        fp8 = {name: str(t.dtype) for name, t in self.tensors.items() if str(t.dtype) in _FP8}
        meta = {
            "names": list(self.tensors),
            "fp8": fp8,
            "recipe": self.recipe,
            "out_features": self.out_features,
            "in_features": self.in_features,
            "info": {k: v for k, v in self.info.items() if isinstance(v, (bool, int, float, str))},
            **self._meta_extra(),
        }
        views = [t.view(torch.uint8) if n in fp8 else t for n, t in self.tensors.items()]
        object.__setattr__(self, "op_tensors", views)
        object.__setattr__(self, "op_meta", json.dumps(meta, sort_keys=True))
        _LIVE[id(views[0])] = self

    def _meta_extra(self) -> dict[str, Any]:
        """What a subclass adds to the op meta (and :meth:`from_op_args` reads back as keyword arguments)."""
        return {}

    def cached(self, kind: str, key: tuple, make: Callable[[], Any]) -> Any:
        """``plans.<kind>[key]`` (a table of :class:`PlanCache`), made by ``make()`` on first use; past ``MAX_PLANS``
        entries of all kinds (a workload of that many distinct M) every table starts over, and the C++ table too."""
        table = getattr(self.plans, kind)
        plan = table.get(key)
        if plan is None:
            if len(self.plans) >= MAX_PLANS:
                self.plans.clear()
                if self.fast is not None:
                    self.fast.clear()
            plan = table[key] = make()
        return plan

    def __getstate__(self) -> dict[str, Any]:  # pickling and deep copies: plans hold raw pointers, make new ones
        return {**self.__dict__, "plans": PlanCache(), "fast": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _LIVE[id(self.op_tensors[0])] = self

    def __repr__(self) -> str:  # what it holds, not the tensors' values
        tensors = ", ".join(f"{n}={str(t.dtype)[6:]}{list(t.shape)}" for n, t in self.tensors.items())
        extra = "".join(f", {k}={v}" for k, v in self._meta_extra().items())
        return (
            f"{type(self).__name__}(backend={self.backend!r}, recipe={getattr(self.recipe, 'value', self.recipe)!r}, "
            f"out_features={self.out_features}, in_features={self.in_features}{extra}, {tensors}, "
            f"{self.nbytes} bytes on {self.device})"
        )

    @property
    def device(self) -> torch.device:
        return self._device

    def traced_args(self) -> dict[str, Any]:
        """The op's weight arguments as a traced call reads them: one plain dict (``tensors`` by position,
        ``backend``, ``meta``) for a layer to hold in its own ``__dict__`` (``MXFP8Linear._traced`` says why)."""
        return {"tensors": dict(enumerate(self.op_tensors)), "backend": self.backend, "meta": self.op_meta}

    @property
    def nbytes(self) -> int:
        """Bytes the prepared tensors hold (distinct storages counted once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors.values()}
        return sum(storages.values())

    @classmethod
    def from_op_args(cls, backend: str, tensors: list[torch.Tensor], meta: str) -> PreparedWeight:
        """Inverse of (``op_tensors``, ``op_meta``), on every call of the op: the live weight that holds these very
        tensors (with its launch plans), else one rebuilt from them (cheap, but its plans are made anew)."""
        live = _LIVE.get(id(tensors[0])) if tensors else None
        if (
            live is not None
            and live.backend == backend
            and live.op_meta == meta
            and len(live.op_tensors) == len(tensors)
            and all(map(operator.is_, live.op_tensors, tensors))
        ):
            return live
        m = _parse_meta(meta)
        fp8 = m["fp8"]
        named = {n: t.view(_FP8[fp8[n]]) if n in fp8 else t for n, t in zip(m["names"], tensors, strict=True)}
        extra = {f.name: m[f.name] for f in dataclasses.fields(cls) if f.name in m and f.name not in _META_KEYS}
        return cls(backend, m["recipe"], m["out_features"], m["in_features"], named, m["info"], tensors, meta, **extra)


_META_KEYS = {"names", "fp8", "recipe", "out_features", "in_features", "info"}


@dataclass(frozen=True, repr=False)
class PreparedGroupedWeight(PreparedWeight):
    """The weights of ``experts`` experts, ``[E, N, K]`` (``out_features`` N and ``in_features`` K each), prepared once
    for one backend (:class:`mxgemm.backends.capabilities.GroupedWeights`); it crosses the op boundary as a dense
    weight does, its expert count in the meta."""

    experts: int = 0

    def _meta_extra(self) -> dict[str, Any]:
        return {"experts": self.experts}


class Backend(ABC):
    """One way to run ``y = x @ W^T (+ bias)``. Subclasses live one to a file under ``mxgemm.backends``."""

    name: ClassVar[str]
    recipes: ClassVar[tuple[Recipe, ...]]  # the recipes it computes; the first is its default
    tunable: ClassVar[bool] = False
    summary: ClassVar[str] = ""

    @property
    def default_recipe(self) -> str:
        return self.recipes[0]

    @abstractmethod
    def check_device(self, device: DeviceInfo) -> Availability:
        """Can this backend run on ``device``? Never raises; the reason says what is missing."""

    def check_problem(self, out_features: int, in_features: int) -> Availability:
        """Can it run a weight of this shape? Checked after the device check."""
        return Availability(True, "any shape")

    @abstractmethod
    def prepare(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedWeight:
        """Turn checkpoint tensors (float8 [N, K], uint8 [N, K/32]) into this backend's prepared weight, once."""

    @abstractmethod
    def run(
        self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic: Any = None
    ) -> torch.Tensor:
        """``x`` [M, K] -> [M, N] in ``x.dtype``; inputs are already validated. ``tactic``: one of
        :meth:`tactics`, or None for the default."""

    def plan(
        self, weight: PreparedWeight, m: int, x_dtype: torch.dtype, tactic: Any = None
    ) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
        """What an eager call of M rows runs: ``(x, bias) -> y``, the same as :meth:`run` with ``tactic``, with
        whatever can be worked out ahead worked out once, for ``x`` [M, K] or [..., K] whose leading dimensions hold
        M rows (``y`` then [..., N]). Backends with a launch path of their own override it. A plan lives in
        ``weight.plans.launch`` and must not hold the weight itself (that cycle would keep a dropped weight's memory
        until a garbage collection)."""
        ref = weakref.ref(weight)
        return any_rows(lambda x, bias: self.run(x, ref(), bias, tactic=tactic))

    def export_mx(self, weight: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        """The MX checkpoint tensors (float8 ``[N, K]``, uint8 E8M0 ``[N, K/32]``) that dequantize to exactly the
        weight this backend computes with, rebuilt from the prepared tensors (views of them where the layout allows):
        a prepared weight is the only copy a layer keeps. This default serves backends that keep the MX pair as
        given."""
        return weight.tensors["qdata"], weight.tensors["scale"]

    def tuning_context(self, weight: PreparedWeight) -> contextlib.AbstractContextManager:
        """Entered while the autotuner times this backend on ``weight``: a backend whose library tunes itself
        (FlashInfer) switches that library's tuning on here, and saves what it learns where a restart finds it."""
        return contextlib.nullcontext()

    def tactics(self, m: int, weight: PreparedWeight) -> list[Any]:
        """Tactics the autotuner may try for M rows (:class:`Tactic` or JSON values); the first is the default and
        always valid. Backends with more than one set ``tunable = True``."""
        return [None]
