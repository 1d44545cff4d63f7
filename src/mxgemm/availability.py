"""The answer every capability check gives (a backend's, a kernel library's): available or not, with a reason a user
can act on either way; and the probes that answer for libraries without a capability query. The kernel bindings and
the backends both answer with it."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .device import DeviceInfo
    from .format import MXTensor

__all__ = ["Availability", "probe_against_twin", "probe_operands", "probe_preconditions"]


@dataclass(frozen=True)
class Availability:
    """A check's answer: ``available`` and, either way, a reason a user can act on."""

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available


def probe_operands(index: int, n: int, k: int, m: int) -> tuple[MXTensor, torch.Tensor]:
    """A probe's operands on CUDA device ``index``, the same on every call: an MX-quantized random weight [n, k]
    (an ``MXTensor``) and bf16 activations [m, k]."""
    from . import format as mxformat

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
