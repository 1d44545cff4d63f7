"""The backend registry and the order ``auto`` tries them in.

Adding a backend: one file here defining a :class:`Backend`, one entry in ``_REGISTRY``, one place in
``AUTO_PRIORITY``. ``auto`` walks ``AUTO_PRIORITY`` and takes the first backend whose own checks pass on the device.
"""

from __future__ import annotations

from ..errors import UnknownBackendError
from .base import RECIPES, Availability, Backend, PreparedWeight, UnsupportedWeightError
from .cublas_block import CublasBlockBackend
from .cublas_mx import CublasMXBackend
from .emulation import EmulationBackend
from .flashinfer_mx import FlashInferCuteDSL, FlashInferCutlass, FlashInferTRTLLM
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
    b.name: b
    for b in (
        FlashInferCuteDSL(),
        FlashInferCutlass(),
        CublasMXBackend(),
        HybridSM90Backend(),
        FlashInferTRTLLM(),
        CublasBlockBackend(),
        TritonBackend(),
        EmulationBackend(),
    )
}

# The order `auto` tries backends in, fastest first; each joins only if its own checks pass (FlashInfer's answer,
# a cuBLAS probe, ...), so one list serves every GPU. `flashinfer_trtllm` comes last before `triton`, as the engines
# keep it (its weights must be shuffled); `cublas_block` runs only when named: on SM90 `hybrid_sm90` serves its
# regime from the same stored weight and also covers small M.
AUTO_PRIORITY: tuple[str, ...] = (
    "flashinfer_cutedsl",
    "flashinfer_cutlass",
    "cublas_mx",
    "hybrid_sm90",
    "flashinfer_trtllm",
    "triton",
    "emulation",
)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``; raises :class:`UnknownBackendError` listing the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        valid = ", ".join(["auto", *_REGISTRY])
        raise UnknownBackendError(f"unknown backend {name!r}; valid names: {valid}") from None
