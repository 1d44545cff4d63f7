"""The one resolver: explicit requests run or raise with the reason; auto walks the priority list."""

import logging

import pytest
import torch

import mxgemm
from mxgemm import backends as registry
from mxgemm.backends.base import Availability
from mxgemm.backends.emulation import EmulationBackend
from mxgemm.device import DeviceInfo

H200 = DeviceInfo(type="cuda", name="NVIDIA H200", capability=(9, 0), index=0)
T4 = DeviceInfo(type="cuda", name="Tesla T4", capability=(7, 5), index=0)
CPU = DeviceInfo(type="cpu")


def test_unknown_backend_lists_valid_names():
    with pytest.raises(mxgemm.UnknownBackendError, match=r"'cutlass'.*auto, triton, emulation"):
        mxgemm.resolve_backend("cutlass", device=CPU)


def test_explicit_unavailable_raises_with_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(mxgemm.BackendUnavailableError, match="needs a CUDA GPU; this device is cpu") as e:
        mxgemm.resolve_backend("triton", device=CPU)
    assert e.value.backend == "triton"
    with pytest.raises(mxgemm.BackendUnavailableError, match=r"compute capability >= 8.0.*SM75"):
        mxgemm.resolve_backend("triton", device=T4)


def test_explicit_recipe_mismatch_raises():
    with pytest.raises(mxgemm.BackendUnavailableError, match="not the requested recipe w8a8-block"):
        mxgemm.resolve_backend("triton", device=H200, recipe="w8a8-block")
    with pytest.raises(ValueError, match="unknown recipe 'w4a4'"):
        mxgemm.resolve_backend("emulation", device=CPU, recipe="w4a4")


def test_auto_order_on_pretended_devices(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert mxgemm.resolve_backend("auto", device=H200).name == "triton"
    with caplog.at_level(logging.INFO, logger="mxgemm"):
        assert mxgemm.resolve_backend("auto", device=T4).name == "emulation"
    assert "auto chose 'emulation'" in caplog.text and "skipped triton (needs compute capability" in caplog.text
    res = mxgemm.explain_auto(CPU)
    assert res.backend.name == "emulation" and res.skipped[0][0] == "triton"


def test_auto_filters_by_recipe():
    res = mxgemm.explain_auto(H200, recipe="w8a8-mx")
    assert res.backend.name == "emulation" and res.recipe == "w8a8-mx"
    assert "not the requested recipe w8a8-mx" in dict(res.skipped)["triton"]


def test_triton_package_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(mxgemm.BackendUnavailableError, match="'triton' package is not installed"):
        mxgemm.resolve_backend("triton", device=H200)


class _FlakyBackend(EmulationBackend):
    """A pretend fast backend: runs only on SM100, and only for N % 128 == 0."""

    name = "fake_fast"

    def check_device(self, device):
        if device.sm != 100:
            return Availability(False, f"needs SM100, this is {device}")
        return Availability(True, "SM100")

    def check_problem(self, out_features, in_features):
        if out_features % 128:
            return Availability(False, f"N={out_features} is not a multiple of 128")
        return Availability(True, "ok")


@pytest.fixture
def fake_registry(monkeypatch):
    fake = _FlakyBackend()
    monkeypatch.setitem(registry._REGISTRY, fake.name, fake)
    monkeypatch.setattr("mxgemm.resolve.AUTO_PRIORITY", ("fake_fast", "triton", "emulation"))
    return fake


def test_capability_check_failure_falls_back(fake_registry, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    b200 = DeviceInfo(type="cuda", name="B200", capability=(10, 0))
    sm107 = DeviceInfo(type="cuda", name="pretend", capability=(10, 7))
    assert mxgemm.resolve_backend("auto", device=b200, shape=(256, 512)).name == "fake_fast"
    assert mxgemm.resolve_backend("auto", device=b200, shape=(130, 512)).name == "triton"
    res = mxgemm.explain_auto(sm107)
    assert res.backend.name == "triton" and res.skipped == (("fake_fast", "needs SM100, this is pretend (SM107)"),)
    with pytest.raises(mxgemm.BackendUnavailableError, match="N=130 is not a multiple of 128"):
        mxgemm.resolve_backend("fake_fast", device=b200, shape=(130, 512))


def test_env_sets_default_request(monkeypatch):
    monkeypatch.setenv("MXGEMM_BACKEND", "emulation")
    assert mxgemm.resolve_backend(device=H200).name == "emulation"
    monkeypatch.setenv("MXGEMM_BACKEND", "nope")
    with pytest.raises(mxgemm.UnknownBackendError):
        mxgemm.resolve_backend(device=H200)


def test_available_backends_rows(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = {r.name: r for r in mxgemm.available_backends(CPU)}
    assert set(rows) == {"triton", "emulation"}
    assert not rows["triton"].available and "CUDA" in rows["triton"].reason
    assert rows["emulation"].available and rows["emulation"].recipes == ("w8a16", "w8a8-mx", "w8a8-block")


def test_triton_interpreter_is_an_explicit_cpu_mode(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in mxgemm.resolve_backend("triton", device=CPU).check_device(CPU).reason


def test_describe_device():
    d = mxgemm.describe_device("cpu")
    assert d.type == "cpu" and d.sm is None and str(d) == "cpu"
    assert mxgemm.describe_device(H200) is H200 and H200.sm == 90
    assert mxgemm.describe_device(torch.device("cpu")).torch_device == torch.device("cpu")
