"""The backend registry and the order ``auto`` tries them in.

Adding a backend: one file here defining a :class:`Backend` subclass with a ``name`` (found when this package is
imported) and, for ``auto`` to try it, one place in ``AUTO_PRIORITY``. ``auto`` walks ``AUTO_PRIORITY`` and takes the
first backend whose own checks pass on the device.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

from ..errors import UnknownBackendError
from .base import RECIPES, Availability, Backend, PreparedGroupedWeight, PreparedWeight, UnsupportedWeightError

__all__ = [
    "AUTO_PRIORITY",
    "RECIPES",
    "Availability",
    "Backend",
    "PreparedGroupedWeight",
    "PreparedWeight",
    "UnsupportedWeightError",
    "backend_names",
    "get_backend",
]

# The order `auto` tries backends in, fastest first; each joins only if its own checks pass (FlashInfer's answer,
# a cuBLAS probe, ...), so one list serves every GPU. `flashinfer_trtllm` comes last before `triton`, as the engines
# keep it (its weights must be shuffled); `flashinfer_cudnn` (which also runs experts) after PyTorch's `cublas_mx`, as
# FlashInfer's own `auto` puts cuDNN after CUTLASS; `cublas_block` runs only when named: on SM90 `hybrid_sm90` serves
# its regime from the same stored weight and also covers small M.
AUTO_PRIORITY: tuple[str, ...] = (
    "flashinfer_cutedsl",
    "flashinfer_cutlass",
    "cublas_mx",
    "flashinfer_cudnn",
    "hybrid_sm90",
    "flashinfer_trtllm",
    "triton",
    "emulation",
)


def _discover() -> dict[str, Backend]:
    """One instance of every concrete backend class defined in this package's modules, ``AUTO_PRIORITY``'s first."""
    found: dict[str, Backend] = {}
    for module_info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        for cls in vars(module).values():
            defined_here = isinstance(cls, type) and cls.__module__ == module.__name__ and issubclass(cls, Backend)
            if defined_here and "name" in vars(cls) and not inspect.isabstract(cls):
                found[cls.name] = cls()
    rank = {name: i for i, name in enumerate(AUTO_PRIORITY)}
    return dict(sorted(found.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0])))


_REGISTRY: dict[str, Backend] = _discover()


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; raises :class:`UnknownBackendError` listing the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        valid = ", ".join(["auto", *_REGISTRY])
        raise UnknownBackendError(f"unknown backend {name!r}; valid names: {valid}") from None
