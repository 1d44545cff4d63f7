"""cublas_block / hybrid_sm90 preparation on CPU, the hybrid's exactness gate, and their emulated twins."""

import dataclasses
import os

import pytest
import torch
from helpers import random_act, random_mx_weight, sqnr_db

import mxgemm
from mxgemm.backends.base import UnsupportedWeightError
from mxgemm.backends.emulation import EmulationBackend, emulate_linear
from mxgemm.backends.hybrid_sm90 import HybridSM90Backend
from mxgemm.block128 import dequantize_1x128, prepare_block128, quantize_1x128, reencode_block128
from mxgemm.recipes import hybrid_crossover as crossover_for

interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1")


def test_prepare_pads_for_cublaslt():
    q, s = random_mx_weight(130, 96)
    tensors, info = prepare_block128(q, s)
    block = reencode_block128(q, s)
    assert tensors["qdata"].shape == (144, 512) and tensors["block_scale"].shape == (2, 4)
    assert torch.equal(tensors["qdata"][:130, :96].view(torch.uint8), block.qdata.view(torch.uint8))
    assert (
        int(tensors["qdata"][130:].view(torch.uint8).sum()) == 0
        and int(tensors["qdata"][:, 96:].view(torch.uint8).sum()) == 0
    )
    assert torch.equal(tensors["block_scale"][:, :1], block.scale)
    assert info["reencode"] == block.report


def _outlier_weight():
    q, s = random_mx_weight(256, 512, seed=3)
    s = s.clone()
    s[0] += 12  # one row 4096x larger: its 128-row blocks push neighbours' small values into E4M3 subnormals
    return q, s


def test_hybrid_refuses_weights_that_re_encoding_would_change(monkeypatch):
    q, s = _outlier_weight()
    report = reencode_block128(q, s).report
    assert report.rel_error > 1e-5
    with pytest.raises(UnsupportedWeightError, match="MXGEMM_REENCODE_MAX_ERROR=1e-05"):
        HybridSM90Backend().prepare(q, s, "hybrid-block128")
    monkeypatch.setenv("MXGEMM_REENCODE_MAX_ERROR", "1")
    w = HybridSM90Backend().prepare(q, s, "hybrid-block128")
    assert w.info["crossover"] == crossover_for(256, 512) == 48 and w.info["reencode"] == report
    q2, s2 = random_mx_weight(256, 512)
    assert HybridSM90Backend().prepare(q2, s2, "hybrid-block128").info["reencode"].rel_error < 1e-5


@pytest.mark.parametrize("m", [3, crossover_for(256, 512)])
def test_hybrid_twin_switches_recipe_at_the_crossover(m):
    q, s = random_mx_weight(256, 512)
    x = random_act(m, 512)
    w = EmulationBackend().prepare(q, s, "hybrid-block128")
    wd = reencode_block128(q, s).dequantize().double()
    small = m < crossover_for(256, 512)
    xe = x.double() if small else dequantize_1x128(*quantize_1x128(x)).double()
    y = emulate_linear(x, w, None)
    assert sqnr_db(y, xe @ wd.T) > 45
    other = dequantize_1x128(*quantize_1x128(x)).double() if small else x.double()
    assert sqnr_db(y, other @ wd.T) < 40  # the other regime's recipe is measurably different


@interpreter
def test_act_quant_kernel_layout_and_scales():
    from mxgemm.kernels.act_quant import quantize_1x128_padded

    x = random_act(5, 416) * 3
    x[2] = 0
    q, s = quantize_1x128_padded(x)
    rq, rs = quantize_1x128(x)
    assert q.shape == (8, 512) and s.shape == (8, 4) and s.stride() == (1, 8)
    q64, s64 = quantize_1x128_padded(x, 64)  # whole token tiles for the FP8 kernel
    assert q64.shape == (64, 512) and s64.stride() == (1, 64) and torch.equal(s64[:5], s[:5])
    assert torch.equal(q64[:8].view(torch.uint8), q.view(torch.uint8)) and int(q64[8:].view(torch.uint8).sum()) == 0
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize_1x128_padded(x, 6)
    assert torch.equal(s[:5, :4], rs)  # bit-exact scales
    assert int(q[5:].view(torch.uint8).sum()) == 0 and int(q[:, 416:].view(torch.uint8).sum()) == 0
    # Triton 3.6's interpreter rounds fp32 -> fp8 wrongly across binades (125.9 -> 64), so only signs and
    # magnitudes to within 2x are checked here; tests/gpu/test_gpu_block128.py checks the bits on the GPU
    a, b = q[:5, :416].float(), rq.float()
    assert torch.equal(torch.sign(a), torch.sign(b)) and ((a - b).abs() <= b.abs() / 2 + 2.0**-9).all()


@interpreter
@pytest.mark.parametrize("split_k", [1, 3])
def test_block_scaled_w8a16_kernel(split_k):
    from mxgemm.kernels.w8a16 import W8A16Config, w8a16_linear

    cfg = W8A16Config(bn=64 if split_k == 1 else 32, bm=16, bk=128, split_k=split_k)
    q, s = random_mx_weight(200, 416)
    tensors, _ = prepare_block128(q, s)
    x = random_act(5, 416)
    y = w8a16_linear(
        x, tensors["qdata"][:200].view(torch.uint8), tensors["block_scale"], None, block_scaled=True, config=cfg
    )
    assert sqnr_db(y, x.double() @ reencode_block128(q, s).dequantize().double().T) > 40  # interpreter truncates
    with pytest.raises(ValueError, match="block-scaled"):
        w8a16_linear(
            x,
            q.view(torch.uint8),
            tensors["block_scale"],
            None,
            block_scaled=True,
            config=dataclasses.replace(cfg, bk=64),
        )


def test_crossover_rule():
    # large weights: cuBLASLt beats the Triton kernel from the smallest M measured, the CUDA kernel up to M = 16
    assert crossover_for(28672, 4096, small_m=False) == 1 and crossover_for(28672, 4096) == 17
    assert crossover_for(4096, 14336) == 96 and crossover_for(4096, 4096) == 48
    assert crossover_for(4096, 4096, small_m=False) == 48
    # with our FP8 kernel the quantized regime starts at M = 1 on large weights, at 16 on mid-size ones, 32 on small
    assert crossover_for(28672, 4096, fp8=True) == 1 and crossover_for(8192, 28672, fp8=True) == 1
    assert crossover_for(4096, 14336, fp8=True) == 16 and crossover_for(7168, 7168, fp8=True) == 16
    assert crossover_for(6144, 4096, fp8=True) == 17 and crossover_for(4096, 4096, fp8=True) == 17


def test_layer_recipes_and_emulation_of_the_new_recipe():
    lin = torch.nn.Linear(512, 256).bfloat16()
    layer = mxgemm.MXFP8Linear.from_linear(lin, backend="emulation", recipe="hybrid-block128")
    assert layer.recipe == "hybrid-block128"
    with torch.no_grad():
        assert sqnr_db(layer(random_act(4, 512)), lin(random_act(4, 512))) > 25
