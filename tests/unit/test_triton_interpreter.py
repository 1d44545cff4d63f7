"""The ``triton`` w8a16 kernel under Triton's CPU interpreter, against its emulated twin, on odd shapes."""

import os

import pytest
import torch
from helpers import random_act, random_mx_weight, sqnr_db

import mxgemm
from mxgemm.backends.emulation import emulate_linear

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter tests run without a GPU (TRITON_INTERPRET=1)"
)
# Triton 3.6's interpreter truncates fp32 -> bf16 instead of rounding to nearest (up to 1 ulp, 2^-7 relative), so
# outputs are held to 40 dB here; on a GPU the same comparisons hold at 45+ dB (tests/gpu/test_gpu_triton.py).
MIN_SQNR = 40


def _twin(x, q, s, bias):
    w = mxgemm.prepare_weight(q, s, backend="emulation")
    t = w.tensors
    return (x.double() @ mxgemm.dequantize(mxgemm.MXTensor(t["qdata"], t["scale"])).double().T) + (
        0 if bias is None else bias.double()
    )


@pytest.mark.parametrize("m,n,k", [(1, 130, 96), (3, 130, 96), (3, 64, 256), (20, 48, 160), (70, 130, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_emulated_twin(m, n, k, dtype, with_bias):
    q, s = random_mx_weight(n, k, seed=m + n)
    x = random_act(m, k, dtype=dtype, seed=k)
    bias = torch.randn(n, dtype=dtype) if with_bias else None
    w = mxgemm.prepare_weight(q, s, backend="triton")
    y = mxgemm.linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (m, n) and torch.isfinite(y).all()
    ref = _twin(x, q, s, bias)
    assert sqnr_db(y, ref) > MIN_SQNR  # output rounding to bf16/fp16 only
    twin = emulate_linear(x, mxgemm.prepare_weight(q, s, backend="emulation"), bias)
    assert (y.float() - twin.float()).abs().max() <= 2 * torch.finfo(dtype).eps * twin.float().abs().max()


def test_every_output_written_and_strided_input():
    from mxgemm.kernels.w8a16 import w8a16_linear

    q, s = random_mx_weight(130, 96)
    x = random_act(40, 192)[:, ::2]  # non-unit column stride
    out = torch.full((40, 130), float("nan"), dtype=torch.bfloat16)
    w8a16_linear(x, q.view(torch.uint8), s, None, out=out)
    assert torch.isfinite(out).all()
    assert sqnr_db(out, _twin(x, q, s, None)) > MIN_SQNR
    with pytest.raises(ValueError, match="out must be"):
        w8a16_linear(x, q.view(torch.uint8), s, None, out=torch.empty(40, 131, dtype=torch.bfloat16))


def test_e5m2_weights():
    q, s = random_mx_weight(64, 128, elem_dtype=torch.float8_e5m2)
    x = random_act(3, 128)
    y = mxgemm.linear(x, mxgemm.prepare_weight(q, s, backend="triton"))
    assert sqnr_db(y, _twin(x, q, s, None)) > MIN_SQNR


def test_extreme_scales_and_subnormal_elements():
    q, s = random_mx_weight(64, 128)
    s = s.clone()
    s[0, 0], s[1, 1], s[2, 2] = 0, 200, 1  # 2^-127, 2^73, 2^-126
    q = q.clone()
    q[3, :8] = torch.tensor([2.0**-9, -(2.0**-9), 2.0**-7, 0.0, -0.0, 448.0, -448.0, 2.0**-8]).to(q.dtype)
    x = random_act(2, 128)
    y = mxgemm.linear(x, mxgemm.prepare_weight(q, s, backend="triton")).float()
    ref = _twin(x, q, s, None)
    assert torch.isfinite(y).all()
    assert sqnr_db(y, ref) > MIN_SQNR


def test_nan_scale_and_nan_element_make_their_columns_nan():
    q, s = random_mx_weight(64, 128)
    s, q = s.clone(), q.clone()
    s[5, 2] = 255
    q[9, 17] = float("nan")
    x = random_act(3, 128)
    y = mxgemm.linear(x, mxgemm.prepare_weight(q, s, backend="triton"))
    twin = emulate_linear(x, mxgemm.prepare_weight(q, s, backend="emulation"), None)
    assert torch.equal(torch.isnan(y), torch.isnan(twin))
    assert torch.isnan(y[:, [5, 9]]).all() and torch.isfinite(y[:, :5]).all()


@pytest.mark.parametrize(
    "cfg",
    [
        dict(bn=32, bm=16, bk=64, split_k=3, packed=False),
        dict(bn=16, bm=32, bk=32, split_k=2, packed=False),
        dict(bn=64, bm=16, bk=128, split_k=1, packed=True),
        dict(bn=16, bm=16, bk=256, split_k=4, packed=False),
    ],
)
def test_split_k_and_decodes(cfg):
    from mxgemm.kernels.w8a16 import W8A16Config, w8a16_linear

    cfg = W8A16Config(**cfg)
    q, s = random_mx_weight(130, 416, seed=11)  # K = 13 x 32: ragged last tiles in every split
    x = random_act(5, 416)
    bias = torch.randn(130, dtype=torch.bfloat16)
    first = w8a16_linear(x, q.view(torch.uint8), s, bias, config=cfg)
    assert sqnr_db(first, _twin(x, q, s, bias)) > MIN_SQNR
    again = w8a16_linear(x, q.view(torch.uint8), s, bias, config=cfg)  # counters were reset: same bits
    assert torch.equal(first, again)


def test_preparation_picks_fast_paths_only_when_safe():
    from mxgemm.backends.triton_w8a16 import kernel_scales

    q, s = random_mx_weight(64, 128)
    w = mxgemm.prepare_weight(q, s, backend="triton")
    assert w.info == {"plain_scales": True, "packed_decode": True}
    q2, s2 = q.clone(), s.clone()
    q2[0, :32] = 0.0
    s2[0, 0] = 0  # an all-zero block with scale 0: harmless, rewritten to 127
    s2[1, 1] = 140  # above the packed decoder's range
    w2 = mxgemm.prepare_weight(q2, s2, backend="triton")
    assert w2.tensors["scale"][0, 0].item() == 127 and w2.info == {"plain_scales": True, "packed_decode": False}
    q3, s3 = q.clone(), s.clone()
    q3[2, 3] = 0.5
    s3[2, 0] = 0  # a real 2^-127 scale: the general decoder
    assert mxgemm.prepare_weight(q3, s3, backend="triton").info["plain_scales"] is False
    x = random_act(3, 128)
    for qq, ss in ((q2, s2), (q3, s3)):
        y = mxgemm.linear(x, mxgemm.prepare_weight(qq, ss, backend="triton"))
        assert sqnr_db(y, _twin(x, qq, ss, None)) > MIN_SQNR
    assert kernel_scales(q3, s3)[2, 0].item() == 0


@pytest.mark.parametrize("elem", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_dequantize_kernel_gives_the_exact_values_in_bf16(elem):
    """Every MX value times its scale is a bf16: the kernel's output equals the fp32 dequantization bit for bit,
    NaN blocks and 2^-127 scales included."""
    from mxgemm.backends.triton_w8a16 import kernel_scales
    from mxgemm.kernels.dequant import dequantize_bf16

    q, s = random_mx_weight(70, 160, elem_dtype=elem)
    q, s = q.clone(), s.clone()
    s[0, 0], s[1, 1], s[2, 2], s[4, 0] = 1, 200, 255, 0  # 2^-126, 2^73, NaN, 2^-127
    q[3, :4] = torch.tensor([2.0**-9, -(2.0**-9), 0.0, -0.0]).to(elem)
    ks = kernel_scales(q, s)
    got = dequantize_bf16(q.view(torch.uint8), ks, e5m2=elem == torch.float8_e5m2)
    want = mxgemm.dequantize(mxgemm.MXTensor(q, s), torch.float32)
    assert got.dtype == torch.bfloat16 and torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.float().nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("with_bias", [True, False])
def test_dequant_path_in_chunks_matches_the_twin(with_bias):
    from mxgemm.kernels.dequant import dequant_linear

    q, s = random_mx_weight(300, 160, seed=3)
    x = random_act(9, 160)
    bias = torch.randn(300, dtype=torch.bfloat16) if with_bias else None
    w = mxgemm.prepare_weight(q, s, backend="triton")
    args = (x, q.view(torch.uint8), w.tensors["scale"], bias)
    chunked = dequant_linear(*args, plain_scales=True, max_chunk_bytes=1)  # 128-row chunks: 128, 128, 44
    assert sqnr_db(chunked, _twin(x, q, s, bias)) > MIN_SQNR
    assert torch.equal(chunked, dequant_linear(*args, plain_scales=True))  # one chunk: the same bits
    with pytest.raises(TypeError, match="bf16 activations"):
        dequant_linear(x.half(), *args[1:])


def test_triton_backend_dequantizes_from_m256_and_offers_it_from_m64():
    from mxgemm.backends.base import Tactic
    from mxgemm.backends.triton_w8a16 import Path
    from mxgemm.thresholds import SM90

    dequant = Tactic(Path.DEQUANT)
    b = mxgemm.backends.get_backend("triton")
    q, s = random_mx_weight(64, 128)
    w = mxgemm.prepare_weight(q, s, backend="triton")
    assert SM90.dequant_min_m == 256 and b.tactics(256, w)[0] == dequant
    assert b.tactics(64, w)[-1] == dequant and dequant not in b.tactics(63, w)
    x = random_act(SM90.dequant_min_m, 128)
    y = b.run(x, w, None)
    assert torch.equal(y, b.run(x, w, None, tactic=dequant))
    assert sqnr_db(y, _twin(x, q, s, None)) > MIN_SQNR
    y16 = b.run(x.half(), w, None, tactic=dequant)  # fp16: the kernel, exact for fp16 activations
    assert y16.dtype == torch.float16 and sqnr_db(y16, _twin(x.half(), q, s, None)) > MIN_SQNR
