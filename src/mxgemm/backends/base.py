"""What every backend provides: a capability check with a reason, a recipe, weight preparation and a run."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..availability import Availability
from ..device import DeviceInfo

if TYPE_CHECKING:
    from ..format import MXTensor

__all__ = ["RECIPES", "Availability", "Backend", "PreparedWeight", "UnsupportedWeightError"]

RECIPES: dict[str, str] = {
    "w8a16": "activations as given (bf16/fp16); MXFP8 weight dequantized exactly",
    "w8a8-mx": "activations quantized to MXFP8 (1x32, E8M0); MXFP8 weight",
    "w8a8-block": "activations quantized to FP8 with FP32 scales per 1x128; weight re-encoded to 128x128 blocks",
    "hybrid-block128": "weight re-encoded to 128x128 blocks; M < crossover: activations as given, else as w8a8-block",
}


class UnsupportedWeightError(Exception):
    """Raised by ``Backend.prepare`` when this particular weight's values rule the backend out (the message says
    why). An explicit request then fails with that reason; ``auto`` moves on to the next backend."""


_FP8 = {str(d): d for d in (torch.float8_e4m3fn, torch.float8_e5m2)}


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
    # eager calls' launch plans by (M, activation dtype, tuning generation): see ``Backend.plan``
    plans: dict[tuple, Callable] = field(default_factory=dict, repr=False, compare=False)

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
        }
        views = [t.view(torch.uint8) if n in fp8 else t for n, t in self.tensors.items()]
        object.__setattr__(self, "op_tensors", views)
        object.__setattr__(self, "op_meta", json.dumps(meta, sort_keys=True))

    def __getstate__(self) -> dict[str, Any]:  # pickling and deep copies: plans hold raw pointers, make new ones
        return {**self.__dict__, "plans": {}}

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def nbytes(self) -> int:
        """Bytes the prepared tensors hold (distinct storages counted once)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.tensors.values()}
        return sum(storages.values())

    @classmethod
    def from_op_args(cls, backend: str, tensors: list[torch.Tensor], meta: str) -> PreparedWeight:
        """Inverse of (``op_tensors``, ``op_meta``); cheap, since it runs on every call of the op."""
        m = _parse_meta(meta)
        fp8 = m["fp8"]
        named = {n: t.view(_FP8[fp8[n]]) if n in fp8 else t for n, t in zip(m["names"], tensors, strict=True)}
        return cls(backend, m["recipe"], m["out_features"], m["in_features"], named, m["info"], tensors, meta)


def finish_output(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """A library GEMM's (possibly padded, bf16) output -> [M, n] in ``x.dtype``, bias added, contiguous."""
    y = y[:, :n]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).contiguous()


def probe_operands(index: int, n: int, k: int, m: int) -> tuple[MXTensor, torch.Tensor]:
    """A probe's operands on CUDA device ``index``, the same on every call: an MX-quantized random weight [n, k]
    (an ``MXTensor``) and bf16 activations [m, k]."""
    from .. import format as mxformat

    dev = torch.device("cuda", index)
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.02).to(dev)
    x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
    return mxformat.quantize(w), x


def probe_preconditions(device: DeviceInfo, library: str) -> Availability | None:
    """What a cuBLAS probe behind our activation quantizer needs before it can run: Triton and a visible CUDA device.
    The reason when one is missing, else None."""
    if importlib.util.find_spec("triton") is None:
        return Availability(False, "the activation quantizer needs 'triton' (pip install 'mxgemm[triton]')")
    if device.index is None or not torch.cuda.is_available():
        return Availability(False, f"cannot probe {library}: no CUDA device is visible to this process")
    return None


def probe_against_twin(what: str, run: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> Availability:
    """Availability of a library GEMM that has no capability query: ``run`` computes (output, emulated twin) on a
    small problem; an exception's text or a wrong result is the reason."""
    try:
        y, ref = run()
        err = ((y.float() - ref).norm() / ref.norm()).item()
    except Exception as exc:  # the error text is the reason
        return Availability(False, f"{what} failed a probe: {str(exc).splitlines()[0][:200]}")
    if not err < 1e-2:
        return Availability(False, f"{what} gave wrong results in a probe (relative error {err:.3g})")
    return Availability(True, f"{what} (probed)")


class Backend(ABC):
    """One way to run ``y = x @ W^T (+ bias)``. Subclasses live one to a file under ``mxgemm.backends``."""

    name: ClassVar[str]
    recipes: ClassVar[tuple[str, ...]]  # the recipes it computes; the first is its default
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
        whatever can be worked out ahead worked out once. Backends with a launch path of their own override it."""
        return lambda x, bias: self.run(x, weight, bias, tactic=tactic)

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
        """Tactics the autotuner may try for M rows (JSON-serializable); the first is the default and always valid.
        Backends with more than one set ``tunable = True``."""
        return [None]
