"""The FP8 kernel's configs without a GPU: the default per shape, what is refused."""

from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.fp8_gemm import default_config


def test_fp8_default_config_fills_the_gpu_once():
    """The FP8 kernel's default up to M = 32: two consumer warpgroups per row tile where the tiles fit one CTA per SM
    (2 K splits if those fit too); otherwise 2 K splits while the row tiles are fewer than two per SM, and the deepest
    ring with which every CTA is resident (the M = 16 configs measured best on the H200). Above: tokens as wgmma M,
    64 weight rows per CTA, 2 K splits while they fit, 6 stages up to four tiles per SM."""
    kc2 = {"RW": 1, "ST": 6, "KC": 2}
    assert default_config(16, 6144, 4096, 132) == {"TN": 16, "SPLITS": 1} | kc2  # 8B qkv: 96 tiles
    assert default_config(16, 4096, 4096, 132) == {"TN": 16, "SPLITS": 2} | kc2  # 8B o: 64 tiles, 128 CTAs
    assert default_config(32, 10240, 8192, 132) == {"TN": 32, "RW": 1, "SPLITS": 2, "ST": 6}  # 160 tiles, 320 CTAs
    assert default_config(16, 57344, 8192, 132) == {"TN": 16, "RW": 1, "SPLITS": 1, "ST": 2}  # 70B gate_up: 896
    tokm = {"WN": 64, "ST": 6}
    assert default_config(64, 4096, 4096, 132) == {"TN": 64, "SPLITS": 2} | tokm  # 8B o: 64 tiles, 128 CTAs
    assert default_config(64, 6144, 4096, 132) == {"TN": 64, "SPLITS": 1} | tokm  # 8B qkv: 96 tiles
    assert default_config(64, 28672, 4096, 132) == {"TN": 64, "SPLITS": 1} | tokm  # 8B gate_up: 448 tiles
    assert default_config(64, 57344, 8192, 132) == {"TN": 64, "WN": 64, "SPLITS": 1, "ST": 4}  # 896 tiles
    assert default_config(256, 4096, 4096, 132) == {"TN": 128, "SPLITS": 1} | tokm  # 128 tiles
    assert default_config(20, 4096, 4096, 132)["TN"] == 32 and default_config(100, 4096, 4096, 132)["TN"] == 128
    assert default_config(1, 4096, 4096, 132)["TN"] == 8 and default_config(40, 4096, 4096, 132)["TN"] == 64
    assert default_config(64, 4096, 4224, 132)["SPLITS"] == 1  # 33 K blocks: no even split
    ms = (1, 16, 32, 33, 64, 65, 256)
    assert all(fp8_gemm.valid_config(default_config(m, n, 4096, 132), 4096) for m in ms for n in (128, 8192))


def test_fp8_kernel_is_the_default_up_to_m_64_and_in_one_wave_up_to_128():
    """Over cuBLASLt: up to M = 64 always, up to M = 128 while one CTA per 64 weight rows fits on the SMs
    (faster at M = 128 on the H200's projections with N <= 8192, slower from N = 9216).
    """
    beats = fp8_gemm.default_beats_cublas
    assert beats(1, 57344, 132) and beats(64, 57344, 132)
    assert beats(65, 4096, 132) and beats(128, 8192, 132) and beats(128, 8448, 132)  # 132 tiles
    assert not beats(128, 8464, 132) and not beats(100, 9216, 132) and not beats(128, 28672, 132)
    assert not beats(129, 128, 132) and not beats(256, 4096, 132)
    assert beats(128, 9216, 144) and not beats(128, 8192, 100)  # per the GPU's SMs


def test_fp8_tactics_add_tokens_as_m_above_32():
    """The tuner's configs: swap-AB only up to M = 32, both kernels above, every one valid and none twice."""
    for m, kp in ((16, 4096), (32, 512), (33, 4096), (64, 14336), (256, 8192)):
        configs = fp8_gemm.tactic_configs(m, kp)
        tokm = [c for c in configs if "WN" in c]
        assert all(fp8_gemm.valid_config(c, kp) for c in configs)
        assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)
        assert (len(tokm) > 0) == (m > 32) and len(configs) > len(tokm)
        assert {c["TN"] for c in tokm} <= ({64} if m <= 64 else {64, 128})


def test_invalid_configs_are_refused():
    assert not fp8_gemm.valid_config({"TN": 128, "RW": 3, "SPLITS": 1, "ST": 2}, 512)
    assert not fp8_gemm.valid_config({"TN": 64, "RW": 1, "SPLITS": 3, "ST": 2}, 512)  # 4 blocks: not 3 splits
    assert not fp8_gemm.valid_config({"TN": 48, "RW": 1, "SPLITS": 1, "ST": 2}, 512)
    assert not fp8_gemm.valid_config({"TN": 128, "RW": 2, "SPLITS": 1, "ST": 8}, 512)  # not a ring depth
    assert fp8_gemm.valid_config({"TN": 64, "RW": 2, "SPLITS": 4, "ST": 4}, 512)
    assert fp8_gemm.valid_config({"TN": 64, "RW": 1, "KC": 2, "SPLITS": 4, "ST": 4}, 512)
    assert not fp8_gemm.valid_config({"TN": 64, "RW": 2, "KC": 2, "SPLITS": 1, "ST": 4}, 512)  # 544 threads
    assert not fp8_gemm.valid_config({"TN": 64, "RW": 1, "KC": 3, "SPLITS": 1, "ST": 4}, 512)
    assert fp8_gemm.valid_config({"TN": 128, "WN": 128, "SPLITS": 4, "ST": 6}, 512)
    assert not fp8_gemm.valid_config({"TN": 32, "WN": 64, "SPLITS": 1, "ST": 4}, 512)  # 64 or 128 tokens
    assert not fp8_gemm.valid_config({"TN": 64, "WN": 256, "SPLITS": 1, "ST": 4}, 512)
    assert not fp8_gemm.valid_config({"TN": 64, "WN": 64, "SPLITS": 1, "ST": 4, "KC": 2}, 512)  # KC: swap-AB only
    assert not fp8_gemm.valid_config({"TN": 64, "RW": 1, "SPLITS": 1, "ST": 4, "XX": 1}, 512)  # no unknown keys
    assert not fp8_gemm.valid_config({"TN": 64, "WN": 64, "RW": 1, "SPLITS": 1, "ST": 4}, 512)  # RW: swap-AB only
    assert not fp8_gemm.valid_config({"TN": 64, "WN": 64, "SPLITS": 3, "ST": 4}, 512)


def test_hybrid_routes_the_quantized_regime_to_the_fp8_kernel(monkeypatch):
    """Without a GPU, the kernels recorded instead of run: from the crossover up to M = 64 (up to 128 while its CTAs
    fit one wave) the FP8 kernel with its default config or the tactic's, cuBLASLt for a cuBLASLt tactic or where the
    kernel is not built, the default config for a config it does not know, and below the crossover no quantized tactic
    at all."""
    import torch

    import mxgemm
    from mxgemm.backends.hybrid_sm90 import HybridSM90Backend, fused_for

    ran = []

    def fake_plan(qdata, block_scale, n, k, m, config, fused):
        assert fused == fused_for(m, n, k)

        def launch(x, bias):
            ran.append(("fp8", config))
            return torch.zeros(x.shape[0], n, dtype=torch.bfloat16)

        return launch

    monkeypatch.setattr(fp8_gemm, "linear_plan", fake_plan)
    monkeypatch.setattr("mxgemm.backends.hybrid_sm90.cublas_block_linear", lambda *a, **k: ran.append(("cublas", None)))
    monkeypatch.setattr("mxgemm.kernels.w8a16.w8a16_linear", lambda *a, **k: ran.append(("triton", None)))
    tensors = {"qdata": torch.empty(4096, 4096, dtype=torch.uint8), "block_scale": torch.ones(32, 32)}
    info = {"crossover": 48, "small_m": True, "fp8_sms": 132}
    w = mxgemm.PreparedWeight("hybrid_sm90", "hybrid-block128", 4096, 4096, tensors, info)
    b = HybridSM90Backend()
    x64, x40 = torch.zeros(64, 4096, dtype=torch.bfloat16), torch.zeros(40, 4096, dtype=torch.bfloat16)
    tuned = {"TN": 32, "RW": 2, "SPLITS": 4, "ST": 2}
    y = b.run(x64, w, None)
    assert y.shape == (64, 4096) and y.dtype == torch.bfloat16
    b.run(x64, w, None, tactic={"path": "fp8", "config": tuned})
    b.run(x64, w, None, tactic={"path": "fp8", "config": {"TN": 48, "RW": 1}})  # from an older kernel
    b.run(x64, w, None, tactic={"path": "cublas"})
    b.run(x40, w, None, tactic={"path": "fp8", "config": tuned})  # a bucket spanning the crossover: not followed
    default = default_config(64, 4096, 4096, 132)
    assert ran == [("fp8", default), ("fp8", tuned), ("fp8", default), ("cublas", None), ("triton", None)]
    ran.clear()
    x128 = torch.zeros(128, 4096, dtype=torch.bfloat16)
    b.run(x128, w, None)  # 64 CTAs of 64 weight rows: one wave
    wide_tensors = tensors | {"qdata": torch.empty(9216, 4096)}
    wide = mxgemm.PreparedWeight("hybrid_sm90", "hybrid-block128", 9216, 4096, wide_tensors, info)
    b.run(x128, wide, None)  # 144 CTAs: cuBLASLt
    b.run(x128, wide, None, tactic={"path": "fp8", "config": tuned | {"TN": 128}})  # a tuned config still runs
    assert ran == [("fp8", default_config(128, 4096, 4096, 132)), ("cublas", None), ("fp8", tuned | {"TN": 128})]
    ran.clear()
    del w.info["fp8_sms"]  # a tuning file's FP8 tactic where the kernel is not built
    b.run(x64, w, None, tactic={"path": "fp8", "config": tuned})
    b.run(x64, w, None)
    assert ran == [("cublas", None), ("cublas", None)]


def test_the_fused_kernel_runs_where_eager_calls_wait_on_the_host():
    """Up to M = 32 on weights of at most 16Mi elements (there its device time stays under an eager call's host
    time), outside graph capture; elsewhere quantizer + GEMM."""
    from mxgemm.backends.hybrid_sm90 import fused_for

    assert fused_for(1, 4096, 4096) == fused_for(32, 3584, 3584) == fused_for(17, 4608, 3584) == "auto"
    assert fused_for(33, 4096, 4096) is False and fused_for(17, 6144, 4096) is False
    assert fused_for(1, 28672, 4096) is False


def test_launch_plans_mirror_the_c_structures():
    """The ctypes structures of the plan entry points have the sizes the CUDA sources assert for theirs (a field
    added on one side only fails here or at compile time)."""
    import ctypes

    from mxgemm.kernels import small_m

    assert ctypes.sizeof(fp8_gemm._LinearPlan) == 96
    assert ctypes.sizeof(small_m._Plan) == 56
