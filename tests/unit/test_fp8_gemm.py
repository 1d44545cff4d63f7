"""The FP8 kernel's configs without a GPU: the hybrid backend's default per shape, what the kernel refuses."""

import pytest

from mxgemm.backends.base import Tactic
from mxgemm.backends.hybrid_sm90 import Path, fp8_beats_cublas, fp8_configs
from mxgemm.backends.hybrid_sm90 import fp8_default as default_config
from mxgemm.kernels import Launch, fp8_gemm, nvcc
from mxgemm.kernels.fp8_gemm import SwapAB, TokensAsM


def test_fp8_default_config_fills_the_gpu_once():
    """The FP8 kernel's default up to M = 32: two consumer warpgroups per row tile where the tiles fit one CTA per SM
    (2 K splits if those fit too); otherwise 2 K splits while the row tiles are fewer than two per SM, and the deepest
    ring with which every CTA is resident (the M = 16 configs measured best on the H200). Above: tokens as wgmma M,
    64 weight rows per CTA, 2 K splits while they fit, 6 stages up to four tiles per SM."""
    assert default_config(16, 6144, 4096, 132) == SwapAB(16, rw=1, kc=2, splits=1, stages=6)  # 8B qkv: 96 tiles
    assert default_config(16, 4096, 4096, 132) == SwapAB(16, kc=2, splits=2, stages=6)  # 8B o: 64 tiles, 128 CTAs
    assert default_config(32, 10240, 8192, 132) == SwapAB(32, splits=2, stages=6)  # 160 tiles, 320 CTAs
    assert default_config(16, 57344, 8192, 132) == SwapAB(16, splits=1, stages=2)  # 70B gate_up: 896
    assert default_config(64, 4096, 4096, 132) == TokensAsM(64, 64, splits=2, stages=6)  # 8B o: 64 tiles, 128 CTAs
    assert default_config(64, 6144, 4096, 132) == TokensAsM(64, 64, splits=1, stages=6)  # 8B qkv: 96 tiles
    assert default_config(64, 28672, 4096, 132) == TokensAsM(64, 64, splits=1, stages=6)  # 8B gate_up: 448 tiles
    assert default_config(64, 57344, 8192, 132) == TokensAsM(64, 64, splits=1, stages=4)  # 896 tiles
    assert default_config(256, 4096, 4096, 132) == TokensAsM(128, 64, splits=1, stages=6)  # 128 tiles
    assert default_config(20, 4096, 4096, 132).tn == 32 and default_config(100, 4096, 4096, 132).tn == 128
    assert default_config(1, 4096, 4096, 132).tn == 8 and default_config(40, 4096, 4096, 132).tn == 64
    assert default_config(64, 4096, 4224, 132).splits == 1  # 33 K blocks: no even split
    ms = (1, 16, 32, 33, 64, 65, 256)
    assert all(default_config(m, n, 4096, 132).valid(4096) for m in ms for n in (128, 8192))


def test_fp8_kernel_is_the_default_up_to_m_64_and_in_one_wave_up_to_128():
    """Over cuBLASLt: up to M = 64 always, up to M = 128 while one CTA per 64 weight rows fits on the SMs
    (faster at M = 128 on the H200's projections with N <= 8192, slower from N = 9216).
    """
    beats = fp8_beats_cublas
    assert beats(1, 57344, 132) and beats(64, 57344, 132)
    assert beats(65, 4096, 132) and beats(128, 8192, 132) and beats(128, 8448, 132)  # 132 tiles
    assert not beats(128, 8464, 132) and not beats(100, 9216, 132) and not beats(128, 28672, 132)
    assert not beats(129, 128, 132) and not beats(256, 4096, 132)
    assert beats(128, 9216, 144) and not beats(128, 8192, 100)  # per the GPU's SMs


def test_fp8_tactics_add_tokens_as_m_above_32():
    """The tuner's configs: swap-AB only up to M = 32, both kernels above, every one valid and none twice."""
    for m, kp in ((16, 4096), (32, 512), (33, 4096), (64, 14336), (256, 8192)):
        configs = fp8_configs(m, kp)
        tokm = [c for c in configs if isinstance(c, TokensAsM)]
        assert all(c.valid(kp) for c in configs)
        assert len(set(configs)) == len(configs)
        assert (len(tokm) > 0) == (m > 32) and len(configs) > len(tokm)
        assert {c.tn for c in tokm} <= ({64} if m <= 64 else {64, 128})


def test_invalid_configs_are_refused():
    assert not SwapAB(128, rw=3, splits=1, stages=2).valid(512)
    assert not SwapAB(64, rw=1, splits=3, stages=2).valid(512)  # 4 blocks: not 3 splits
    assert not SwapAB(48, rw=1, splits=1, stages=2).valid(512)
    assert not SwapAB(128, rw=2, splits=1, stages=8).valid(512)  # not a ring depth
    assert SwapAB(64, rw=2, splits=4, stages=4).valid(512)
    assert SwapAB(64, rw=1, kc=2, splits=4, stages=4).valid(512)
    assert not SwapAB(64, rw=2, kc=2, splits=1, stages=4).valid(512)  # 544 threads
    assert not SwapAB(64, rw=1, kc=3, splits=1, stages=4).valid(512)
    assert TokensAsM(128, 128, splits=4, stages=6).valid(512)
    assert not TokensAsM(32, 64, splits=1, stages=4).valid(512)  # 64 or 128 tokens
    assert not TokensAsM(64, 256, splits=1, stages=4).valid(512)
    assert not TokensAsM(64, 64, splits=3, stages=4).valid(512)
    assert not TokensAsM(64, 64, splits=0, stages=4).valid(512) and not TokensAsM(64, 64, splits=16).valid(8192)


def test_hybrid_routes_the_quantized_regime_to_the_fp8_kernel(monkeypatch):
    """Without a GPU, the kernels recorded instead of run: from the crossover up to M = 64 (up to 128 while its CTAs
    fit one wave) the FP8 kernel with its default config or the tactic's, cuBLASLt for a cuBLASLt tactic or where the
    kernel is not built, and below the crossover no quantized tactic at all."""
    import torch

    import mxgemm
    from mxgemm.backends.hybrid_sm90 import HybridSM90Backend

    ran = []

    def fake_plan(qdata, block_scale, n, k, m, config, graphed=True):
        assert graphed is True  # outside capture, the quantizer and the GEMM as one graph

        def launch(x, bias):
            ran.append(("fp8", config))
            return torch.zeros(x.shape[0], n, dtype=torch.bfloat16)

        entry = ("entry", config)
        return Launch(launch, entry=entry, gated=Launch(lambda gate, up, bias: None, entry=entry))

    monkeypatch.setattr(fp8_gemm, "linear_plan", fake_plan)
    monkeypatch.setattr("mxgemm.backends.hybrid_sm90.blockwise_linear", lambda *a, **k: ran.append(("cublas", None)))
    monkeypatch.setattr("mxgemm.kernels.w8a16.w8a16_linear", lambda *a, **k: ran.append(("triton", None)))
    tensors = {"qdata": torch.empty(4096, 4096, dtype=torch.uint8), "block_scale": torch.ones(32, 32)}
    info = {"crossover": 48, "small_m": True, "fp8_sms": 132}
    w = mxgemm.PreparedWeight("hybrid_sm90", "hybrid-block128", 4096, 4096, tensors, info)
    b = HybridSM90Backend()
    x64, x40 = torch.zeros(64, 4096, dtype=torch.bfloat16), torch.zeros(40, 4096, dtype=torch.bfloat16)
    tuned = SwapAB(32, rw=2, splits=4, stages=2)
    y = b.run(x64, w, None)
    assert y.shape == (64, 4096) and y.dtype == torch.bfloat16
    b.run(x64, w, None, tactic=Tactic(Path.FP8, tuned))
    b.run(x64, w, None, tactic=Tactic(Path.CUBLAS))
    b.run(x40, w, None, tactic=Tactic(Path.FP8, tuned))  # a bucket spanning the crossover: not followed
    default = default_config(64, 4096, 4096, 132)
    assert ran == [("fp8", default), ("fp8", tuned), ("cublas", None), ("triton", None)]
    assert b.plan(w, 64, torch.bfloat16).entry == ("entry", default)  # what C++ calls: the kernel plan's own
    ran.clear()
    x128 = torch.zeros(128, 4096, dtype=torch.bfloat16)
    b.run(x128, w, None)  # 64 CTAs of 64 weight rows: one wave
    wide_tensors = tensors | {"qdata": torch.empty(9216, 4096)}
    wide = mxgemm.PreparedWeight("hybrid_sm90", "hybrid-block128", 9216, 4096, wide_tensors, info)
    b.run(x128, wide, None)  # 144 CTAs: cuBLASLt
    tuned128 = SwapAB(128, rw=2, splits=4, stages=2)
    b.run(x128, wide, None, tactic=Tactic(Path.FP8, tuned128))  # a tuned config still runs
    assert ran == [("fp8", default_config(128, 4096, 4096, 132)), ("cublas", None), ("fp8", tuned128)]
    ran.clear()
    del w.info["fp8_sms"]  # the kernel is not built: cuBLASLt, and no FP8 tactic is offered
    b.run(x64, w, None)
    assert ran == [("cublas", None)] and b.tactics(64, w) == [Tactic(Path.CUBLAS)]


@pytest.mark.skipif(nvcc.find_nvcc() is None, reason="no nvcc on this machine")
def test_the_library_compiles_for_sm90a_and_loads_with_every_entry_point(monkeypatch, tmp_path):
    """Where nvcc exists the FP8 GEMM's library (the GEMMs, the quantizer of quant_1x128.cuh, the helpers of
    sm90.cuh, the LinearPlan layout's static_assert) compiles for sm_90a and loads with each symbol it binds."""
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    fp8_gemm.library.cache_clear()
    try:
        lib = fp8_gemm.library((9, 0))
        assert hasattr(lib, "mxgemm_fp8_linear_run") and hasattr(lib, "mxgemm_quant_gated_1x128")
        assert len(list((tmp_path / "kernels").glob("fp8_gemm-sm90a-*.so"))) == 1
    finally:
        fp8_gemm.library.cache_clear()
