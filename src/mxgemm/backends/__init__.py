"""The backend registry and the order ``auto`` tries them in.

Adding a backend: one file here defining a :class:`Backend`, one entry in ``_REGISTRY``, one place in
``AUTO_PRIORITY``. ``auto`` walks ``AUTO_PRIORITY`` and takes the first backend whose own checks pass on the device.
"""

from __future__ import annotations

from ..errors import UnknownBackendError
from .base import RECIPES, Availability, Backend, PreparedWeight, UnsupportedWeightError
from .cublas_block import CublasBlockBackend
from .emulation import EmulationBackend
from .hybrid_sm90 import HybridSM90Backend
from .triton_w8a16 import TritonBackend

__all__ = [
    "AUTO_PRIORITY",
    "RECIPES",
    "Availability",
    "Backend",
    "PreparedWeight",
    "UnsupportedWeightError",
    "backend_names",
    "get_backend",
]

_REGISTRY: dict[str, Backend] = {
    b.name: b for b in (HybridSM90Backend(), CublasBlockBackend(), TritonBackend(), EmulationBackend())
}

# The order `auto` tries backends in, fastest first; each joins only if its own checks pass. `cublas_block` runs
# only when named: on SM90 `hybrid_sm90` serves its regime from the same stored weight and also covers small M.
AUTO_PRIORITY: tuple[str, ...] = ("hybrid_sm90", "triton", "emulation")


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; raises :class:`UnknownBackendError` listing the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        valid = ", ".join(["auto", *_REGISTRY])
        raise UnknownBackendError(f"unknown backend {name!r}; valid names: {valid}") from None
