"""The FP8 kernel's configs without a GPU: the default per shape, what is refused."""

from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.fp8_gemm import default_config


def test_fp8_default_config_fills_the_gpu_once():
    """The FP8 kernel's default: 2 K splits while the row tiles are fewer than two per SM, and the deepest ring with
    which every CTA is resident (the M = 64 configs measured best on the H200, bench/NOTES.md item 18)."""
    assert default_config(64, 4096, 4096, 132) == {"TN": 64, "RW": 1, "SPLITS": 2, "ST": 6}  # 8B o: 128 CTAs
    assert default_config(64, 10240, 8192, 132) == {"TN": 64, "RW": 1, "SPLITS": 2, "ST": 4}  # 70B qkv: 320 CTAs
    assert default_config(64, 57344, 8192, 132) == {"TN": 64, "RW": 1, "SPLITS": 1, "ST": 2}  # 70B gate_up: 896
    assert default_config(20, 4096, 4096, 132)["TN"] == 32 and default_config(100, 4096, 4096, 132)["TN"] == 64
    assert default_config(64, 4096, 4224, 132)["SPLITS"] == 1  # 33 K blocks: no even split


def test_invalid_configs_are_refused():
    assert not fp8_gemm.valid_config({"TN": 128, "RW": 3, "SPLITS": 1, "ST": 2}, 512)
    assert not fp8_gemm.valid_config({"TN": 64, "RW": 1, "SPLITS": 3, "ST": 2}, 512)  # 4 blocks: not 3 splits
    assert not fp8_gemm.valid_config({"TN": 48, "RW": 1, "SPLITS": 1, "ST": 2}, 512)
    assert not fp8_gemm.valid_config({"TN": 128, "RW": 2, "SPLITS": 1, "ST": 8}, 512)  # not a ring depth
    assert fp8_gemm.valid_config({"TN": 64, "RW": 2, "SPLITS": 4, "ST": 4}, 512)
