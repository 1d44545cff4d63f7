"""The small-M CUDA kernel's CPU side: configs, the build (where nvcc is), reasons when it cannot be had, and the
hybrid backend's tactics around it."""

import pytest
import torch

import mxgemm
from mxgemm.backends.base import Tactic
from mxgemm.backends.hybrid_sm90 import HybridSM90Backend, Path, small_m_default
from mxgemm.kernels import nvcc, small_m
from mxgemm.kernels.small_m import SmallMConfig


@pytest.mark.parametrize(
    "np_,kp,splits",
    [(6144, 4096, 1), (4096, 4096, 1), (28672, 4096, 1), (4096, 14336, 2), (8192, 28672, 1), (144, 512, 1)],
)
def test_default_config_is_the_measured_best_and_tiles_the_weight(np_, kp, splits):
    """One K split, two in a cluster where few CTAs would each stream a long K (the llama3-8b down projection): the
    best configs measured on the H200."""
    cfg = small_m_default(np_, kp)
    assert cfg == SmallMConfig(rt=1, splits=splits, stages=2) and cfg.valid(np_, kp)


def test_accepts_only_what_the_kernel_reads():
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    assert small_m.accepts(x) and small_m.accepts(x[:1])
    assert not small_m.accepts(torch.zeros(17, 64, dtype=torch.bfloat16))  # more than two token tiles
    assert not small_m.accepts(x.half()) and not small_m.accepts(x.t())  # fp16; not contiguous rows
    assert not small_m.accepts(torch.zeros(2 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64))  # 2 bytes off


def test_invalid_configs_are_refused():
    assert SmallMConfig(rt=1, splits=7, stages=3).valid(144, 7168)  # 14 CTA slices: 7 splits of 2
    assert not SmallMConfig(rt=2, splits=1, stages=2).valid(144, 512)  # 144 rows: not whole 32-row tiles
    assert not SmallMConfig(rt=1, splits=2, stages=2).valid(144, 512)  # one 512-deep CTA slice only
    assert not SmallMConfig(rt=1, splits=16, stages=2).valid(144, 16384)  # clusters hold at most 8 CTAs
    assert not SmallMConfig(rt=1, splits=1, stages=4).valid(144, 512)  # ring depths 2 and 3 only
    assert not SmallMConfig(rt=1, splits=0, stages=2).valid(144, 512)


def test_no_nvcc_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(nvcc, "find_nvcc", lambda: None)
    small_m.library.cache_clear()
    small_m.small_m_status.cache_clear()
    try:
        status = small_m.small_m_status((9, 0))
        assert not status and "nvcc was not found" in status.reason and "CUDA_HOME" in status.reason
        assert not small_m.small_m_status((8, 9)) and "SM90+" in small_m.small_m_status((8, 9)).reason
    finally:
        small_m.library.cache_clear()
        small_m.small_m_status.cache_clear()


@pytest.mark.skipif(nvcc.find_nvcc() is None, reason="no nvcc on this machine")
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
    return mxgemm.PreparedWeight(
        "hybrid_sm90", "hybrid-block128", n, k, tensors, {"crossover": crossover, "small_m": small}
    )


@pytest.mark.parametrize("small", [True, False])
def test_hybrid_tactics_keep_the_regime_and_default_to_the_cuda_kernel_up_to_m16(small):
    b = HybridSM90Backend()
    w = _weight(4096, 14336, 96, small)
    for m in (1, 8, 9, 16, 17, 95, 96, 4096):
        tactics = b.tactics(m, w)
        if m >= 96:  # quantized activations from the crossover: one path, whatever a cache says
            assert tactics == [Tactic(Path.CUBLAS)]
            continue
        assert tactics[0].path == (Path.SMALL_M if small and m <= 16 else Path.TRITON)
        assert {t.path for t in tactics} == ({Path.SMALL_M, Path.TRITON} if small and m <= 16 else {Path.TRITON})
        cuda = [t.config for t in tactics if t.path == Path.SMALL_M]
        assert all(c.valid(4096, 14336) for c in cuda) and len(cuda) == len(set(cuda))


def test_a_cached_tactic_of_the_other_regime_is_not_followed(monkeypatch):
    """M=95 maps to the M=128 bucket, tuned above the crossover (96): its cuBLASLt tactic must not quantize the
    activations of an M below the crossover."""
    b = HybridSM90Backend()
    ran = []
    monkeypatch.setattr("mxgemm.backends.hybrid_sm90.blockwise_linear", lambda *a, **k: ran.append("cublas"))
    monkeypatch.setattr("mxgemm.kernels.w8a16.w8a16_linear", lambda *a, **k: ran.append("triton"))
    w = _weight(4096, 14336, 96, False)
    w.tensors["block_scale"] = torch.ones(32, 28)
    b.run(torch.zeros(95, 14336, dtype=torch.bfloat16), w, None, tactic=Tactic(Path.CUBLAS))
    b.run(torch.zeros(96, 14336, dtype=torch.bfloat16), w, None, tactic=b.tactics(64, w)[0])
    assert ran == ["triton", "cublas"]
