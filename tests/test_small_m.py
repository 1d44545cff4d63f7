"""The small-M CUDA kernel's CPU side: configs, the build (where nvcc is), reasons when it cannot be had, and the
hybrid backend's tactics around it."""

import pytest
import torch

import mxgemm
from mxgemm.backends.hybrid_sm90 import HybridSM90Backend
from mxgemm.kernels import small_m


@pytest.mark.parametrize("np_,kp", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (144, 512)])
def test_default_config_tiles_the_weight_and_aims_at_1024_ctas(np_, kp):
    cfg = small_m.default_config(np_, kp)
    assert small_m.valid_config(cfg, np_, kp) and cfg["RT"] == 1
    ctas = np_ // 16 * cfg["SPLITS"]
    assert ctas >= 1024 or kp % (512 * cfg["SPLITS"] * 2) != 0  # more splits would not divide K
    assert cfg["SPLITS"] == 1 or ctas // 2 < 1024


def test_invalid_configs_are_refused():
    assert not small_m.valid_config({"RT": 2, "SPLITS": 1}, 144, 512)  # 144 rows: not whole 32-row tiles
    assert not small_m.valid_config({"RT": 1, "SPLITS": 2}, 144, 512)  # one 512-deep CTA slice only


def test_no_nvcc_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(small_m, "find_nvcc", lambda: None)
    small_m.library.cache_clear()
    small_m.small_m_status.cache_clear()
    try:
        status = small_m.small_m_status((9, 0))
        assert not status and "nvcc was not found" in status.reason and "CUDA_HOME" in status.reason
        assert not small_m.small_m_status((7, 5)) and "SM80+" in small_m.small_m_status((7, 5)).reason
    finally:
        small_m.library.cache_clear()
        small_m.small_m_status.cache_clear()


@pytest.mark.skipif(small_m.find_nvcc() is None, reason="no nvcc on this machine")
def test_kernel_builds_once_and_is_cached_on_disk(monkeypatch, tmp_path):
    """Where nvcc exists (the H200 machine; often CI too) the kernel compiles for SM90 and loads; a second process
    would find it in the cache folder."""
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    small_m.library.cache_clear()
    try:
        lib = small_m.library((9, 0))
        assert hasattr(lib, "mxgemm_small_m")
        built = list((tmp_path / "kernels").glob("small_m-sm90-*.so"))
        assert len(built) == 1
        small_m.library.cache_clear()
        small_m.library((9, 0))  # from disk: nothing rebuilt
        assert list((tmp_path / "kernels").glob("small_m-sm90-*.so")) == built
    finally:
        small_m.library.cache_clear()


def _weight(n, k, crossover, small):
    np_, kp = -(-n // 16) * 16, -(-k // 512) * 512
    tensors = {"qdata": torch.empty((np_, kp), dtype=torch.uint8)}
    return mxgemm.PreparedWeight("hybrid_sm90", "hybrid-block128", n, k, tensors, {"crossover": crossover,
                                                                                     "small_m": small})  # fmt: skip


@pytest.mark.parametrize("small", [True, False])
def test_hybrid_defaults_to_the_cuda_kernel_up_to_m16_where_it_is_built(small):
    b = HybridSM90Backend()
    w = _weight(4096, 14336, 96, small)
    for m in (1, 16, 17, 95, 96):
        tactics = b.tactics(m, w)
        expected = "cublas" if m >= 96 else ("cuda" if small and m <= 16 else "triton")
        assert tactics[0]["path"] == expected
        cuda = [t["config"] for t in tactics if t["path"] == "cuda"]
        assert bool(cuda) == (small and m <= 16)
        assert all(small_m.valid_config(c, 4096, 14336) for c in cuda)
        assert len(cuda) == len({tuple(sorted(c.items())) for c in cuda})
