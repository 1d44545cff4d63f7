"""The one resolver: explicit requests run or raise with the reason; auto walks the priority list."""

import logging

import pytest
import torch
from helpers import hide_package

import mxgemm
from mxgemm import backends as registry
from mxgemm.backends.base import Availability
from mxgemm.backends.emulation import EmulationBackend
from mxgemm.device import DeviceInfo

H200 = DeviceInfo(type="cuda", name="NVIDIA H200", capability=(9, 0), index=0)
T4 = DeviceInfo(type="cuda", name="Tesla T4", capability=(7, 5), index=0)
CPU = DeviceInfo(type="cpu")


def test_unknown_backend_lists_valid_names():
    with pytest.raises(
        mxgemm.UnknownBackendError, match=r"'cutlass'; valid names: auto, flashinfer_cutedsl, .*, emulation"
    ):
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
    res = mxgemm.explain_auto(H200)  # no CUDA runtime here: the cuBLASLt probe cannot run, so Triton
    assert res.backend.name == "triton"
    assert "CUDA" in dict(res.skipped)["hybrid_sm90"]
    with caplog.at_level(logging.INFO, logger="mxgemm"):
        assert mxgemm.resolve_backend("auto", device=T4).name == "emulation"
    assert "auto chose 'emulation'" in caplog.text and "triton (needs compute capability" in caplog.text
    res = mxgemm.explain_auto(CPU)
    assert res.backend.name == "emulation" and [n for n, _ in res.skipped] == list(mxgemm.AUTO_PRIORITY[:-1])


def test_auto_filters_by_recipe():
    res = mxgemm.explain_auto(H200, recipe="w8a8-mx")
    assert res.backend.name == "emulation" and res.recipe == "w8a8-mx"
    assert "not the requested recipe w8a8-mx" in dict(res.skipped)["triton"]


def test_triton_package_missing(monkeypatch):
    hide_package(monkeypatch, "triton")
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
    assert set(rows) == {
        "flashinfer_cutedsl",
        "flashinfer_cutlass",
        "flashinfer_trtllm",
        "flashinfer_cudnn",
        "cublas_mx",
        "hybrid_sm90",
        "cublas_block",
        "triton",
        "emulation",
    }
    assert not rows["cublas_block"].available and "CUDA GPU" in rows["cublas_block"].reason
    assert not rows["triton"].available and "CUDA" in rows["triton"].reason
    assert rows["emulation"].available and rows["emulation"].recipes == tuple(mxgemm.RECIPES)


def test_triton_interpreter_is_an_explicit_cpu_mode(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in mxgemm.resolve_backend("triton", device=CPU).check_device(CPU).reason


def test_describe_device():
    d = mxgemm.describe_device("cpu")
    assert d.type == "cpu" and d.sm is None and str(d) == "cpu"
    assert mxgemm.describe_device(H200) is H200 and H200.sm == 90
    assert mxgemm.describe_device(torch.device("cpu")).torch_device == torch.device("cpu")


@pytest.fixture
def pretend_cuda_runtime(monkeypatch):
    """Pretend a CUDA 13 runtime and a cuBLASLt probe with a given answer (the real probe runs on the H200)."""
    from mxgemm.kernels import cublaslt

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    answers = {}
    monkeypatch.setattr(cublaslt, "probe_blockwise", lambda index: answers.get(index, Availability(True, "probed")))
    return answers


def test_hopper_picks_the_hybrid(pretend_cuda_runtime):
    assert mxgemm.resolve_backend("auto", device=H200).name == "hybrid_sm90"
    assert mxgemm.resolve_backend("cublas_block", device=H200).name == "cublas_block"
    pretend_cuda_runtime[0] = Availability(False, "cuBLASLt blockwise FP8 GEMM failed a probe: NOT_SUPPORTED")
    res = mxgemm.explain_auto(H200)
    assert res.backend.name == "triton" and "NOT_SUPPORTED" in dict(res.skipped)["hybrid_sm90"]


def test_blockwise_needs_hopper_and_new_cuda(pretend_cuda_runtime, monkeypatch):
    b200 = DeviceInfo(type="cuda", name="B200", capability=(10, 0), index=0)
    with pytest.raises(mxgemm.BackendUnavailableError, match=r"runs on Hopper \(SM90\); B200 \(SM100\) is not"):
        mxgemm.resolve_backend("cublas_block", device=b200)
    hide_package(monkeypatch, "flashinfer")  # auto on a Blackwell without FlashInfer
    assert mxgemm.resolve_backend("auto", device=b200).name == "triton"
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    with pytest.raises(mxgemm.BackendUnavailableError, match=r"CUDA >= 12.9.*12.4"):
        mxgemm.resolve_backend("hybrid_sm90", device=H200)


class _PickyBackend(EmulationBackend):
    """Refuses weights whose first element is negative."""

    name = "picky"

    def prepare(self, qdata, scale, recipe):
        if qdata.float()[0, 0] < 0:
            raise registry.UnsupportedWeightError("first element is negative")
        return super().prepare(qdata, scale, recipe)


def test_a_refused_weight_goes_to_the_next_backend(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    picky = _PickyBackend()
    monkeypatch.setitem(registry._REGISTRY, picky.name, picky)
    monkeypatch.setattr("mxgemm.resolve.AUTO_PRIORITY", ("picky", "triton", "emulation"))
    q = torch.full((64, 64), 1.0).to(torch.float8_e4m3fn)
    s = torch.full((64, 2), 127, dtype=torch.uint8)
    assert mxgemm.prepare_weight(q, s).backend == "picky"
    q_neg = (-q.float()).to(torch.float8_e4m3fn)
    with caplog.at_level(logging.INFO, logger="mxgemm"):
        assert mxgemm.prepare_weight(q_neg, s).backend == "emulation"
    assert "'picky' refused a [64, 64] weight: first element is negative" in caplog.text
    with pytest.raises(mxgemm.BackendUnavailableError, match="'picky' cannot run here: this weight: first element"):
        mxgemm.prepare_weight(q_neg, s, backend="picky")


def test_probe_against_twin_reasons():
    from mxgemm.availability import probe_against_twin

    ok = torch.ones(4)

    def fails():
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore detail")

    assert probe_against_twin("a GEMM", lambda: (ok, ok)) == Availability(True, "a GEMM (probed)")
    answer = probe_against_twin("a GEMM", fails)
    assert (
        not answer and answer.reason == "a GEMM failed a probe: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"
    )
    wrong = probe_against_twin("a GEMM", lambda: (ok * 2, ok))
    assert not wrong and "gave wrong results in a probe (relative error 1)" in wrong.reason


def test_every_backend_file_is_registered_and_auto_names_only_registered_backends():
    """A backend is found from its file alone: every concrete Backend class of the package's modules is registered
    under its name; AUTO_PRIORITY names registered backends, in its order first."""
    import importlib
    import inspect
    import pkgutil

    from mxgemm import backends

    defined = set()
    for info in pkgutil.iter_modules(backends.__path__):
        module = importlib.import_module(f"mxgemm.backends.{info.name}")
        for c in vars(module).values():
            if isinstance(c, type) and issubclass(c, backends.Backend) and c.__module__ == module.__name__:
                if "name" in vars(c) and not inspect.isabstract(c):
                    defined.add(c.name)
    names = backends.backend_names()
    assert set(names) == defined and len(names) == 9
    assert names[: len(backends.AUTO_PRIORITY)] == list(backends.AUTO_PRIORITY)
