"""Shared test helpers: error metrics and random MX weights (never zeros)."""

from __future__ import annotations

import math

import torch

import mxgemm


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    noise = (out.double() - ref).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.norm().item() / noise)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return (out.double() - ref).norm().item() / ref.norm().item()


def random_mx_weight(n: int, k: int, *, seed: int = 0, device="cpu", scale: float = 0.02, elem_dtype=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * scale
    t = mxgemm.quantize(w.to(device), elem_dtype=elem_dtype or torch.float8_e4m3fn)
    return t.qdata, t.scale


def skip_unless_backend_runs(name: str) -> None:
    """Skip the calling test (or module fixture) with the backend's own reason when it cannot run here."""
    import pytest

    answer = mxgemm.backends.get_backend(name).check_device(mxgemm.describe_device())
    if not answer.available:
        pytest.skip(f"{name} unavailable: {answer.reason}")


def hide_package(monkeypatch, name: str) -> None:
    """Make ``importlib.util.find_spec(name)`` answer None, as for a package that is not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a))


def random_act(m: int, k: int, *, seed: int = 1, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(device=device, dtype=dtype)


def hybrid_twin(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, *, quantized: bool) -> torch.Tensor:
    """The emulated twin of one ``hybrid_sm90`` regime: activations 1x128-quantized (``quantized``) or as given,
    the weight re-encoded to 128x128 blocks."""
    from mxgemm.backends.emulation import EmulationBackend, emulate_linear

    weight = EmulationBackend().prepare(q, s, "hybrid-block128", crossover=1 if quantized else 2**31)
    return emulate_linear(x, weight, None)


def kernels_launched(fn) -> list[str]:
    """The CUDA kernels ``fn`` launches, by name, as the profiler records them (skips where it records none)."""
    import pytest
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        pytest.skip("the profiler records no CUDA kernels here")
    return names
