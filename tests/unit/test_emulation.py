"""The emulation backend's recipes against independent float references; the 128x128 re-encoding."""

import pytest
import torch
import torch.nn.functional as F
from helpers import random_act, random_mx_weight, rel_err, sqnr_db

import mxgemm
from mxgemm.block128 import dequantize_1x128, quantize_1x128, reencode_block128


def _w_ref(q, s):
    return (q.double().reshape(q.shape[0], -1, 32) * torch.pow(2.0, s.double() - 127).unsqueeze(-1)).reshape(q.shape)


@pytest.mark.parametrize("m,n,k", [(1, 130, 96), (3, 64, 256), (17, 200, 4160)])
def test_w8a16_is_the_exact_weight(m, n, k):
    q, s = random_mx_weight(n, k)
    x = random_act(m, k)
    b = torch.randn(n)
    w = mxgemm.prepare_weight(q, s, backend="emulation")
    assert (w.backend, w.recipe) == ("emulation", "w8a16")
    y = mxgemm.linear(x, w, b)
    ref = x.double() @ _w_ref(q, s).T + b.double()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert sqnr_db(y, ref) > 45  # only bf16 output rounding separates them
    assert sqnr_db(y, F.linear(x.float(), _w_ref(q, s).float(), b)) > 45


def test_w8a8_mx_quantizes_activations():
    q, s = random_mx_weight(64, 256)
    x = random_act(5, 256)
    w = mxgemm.prepare_weight(q, s, backend="emulation", recipe="w8a8-mx")
    xq = mxgemm.dequantize(mxgemm.quantize(x)).double()
    ref = xq @ _w_ref(q, s).T
    y = mxgemm.linear(x, w)
    assert sqnr_db(y, ref) > 45
    assert 20 < sqnr_db(y, x.double() @ _w_ref(q, s).T) < 40  # activation quantization is visible


def test_quantize_1x128_reference():
    x = random_act(4, 288, dtype=torch.float32)
    x[1] = 0.0
    q, s = quantize_1x128(x)
    assert q.shape == (4, 288) and s.shape == (4, 3) and s.dtype == torch.float32
    for r in range(4):
        for g in range(3):
            chunk = x[r, g * 128 : (g + 1) * 128]
            amax = max(chunk.abs().max().item(), 2.0**-64)
            amax32 = torch.tensor(amax, dtype=torch.float32)
            assert s[r, g].item() == (amax32.double() / 448.0).float().item()  # one correctly rounded division
            inv = (448.0 / amax32.double()).float()
            ref = (chunk * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(q[r, g * 128 : (g + 1) * 128].view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(dequantize_1x128(q, s)[1], torch.zeros(288))
    assert rel_err(dequantize_1x128(q, s), x) < 0.04


def test_reencode_is_exact_on_uniform_blocks_and_reports_changes():
    q, s = random_mx_weight(256, 512)
    s = s.clone()
    s[:] = 120  # every 32-block shares one exponent: nothing moves
    b = reencode_block128(q, s)
    assert b.report.changed == 0 and b.report.max_shift == 0 and b.report.rel_error == 0.0
    assert torch.equal(b.dequantize(), mxgemm.dequantize(mxgemm.MXTensor(q, s)))


def test_reencode_outlier_rows():
    q, s = random_mx_weight(300, 4160, seed=5)
    s = s.clone()
    s[7] += 9  # an outlier row: its blocks' exponent rises by 9, pushing its neighbours' small values to subnormals
    b = reencode_block128(q, s)
    mx = mxgemm.dequantize(mxgemm.MXTensor(q, s)).double()
    new = b.dequantize().double()
    assert b.qdata.shape == q.shape and b.scale.shape == (3, 33)
    changed = new != mx
    assert b.report.changed == int(changed.sum()) > 0
    assert b.report.max_shift >= 9
    assert b.report.rel_error == pytest.approx(((new - mx).norm() / mx.norm()).item(), rel=1e-6)
    assert b.report.rel_error < 1e-3
    # block scales are powers of two, the largest exponent of the block
    assert torch.equal(torch.log2(b.scale), torch.round(torch.log2(b.scale)))
    assert "elements changed" in str(b.report)


def test_reencode_keeps_nan_blocks():
    q, s = random_mx_weight(128, 128)
    s = s.clone()
    s[3, 1] = 255
    b = reencode_block128(q, s)
    d = b.dequantize()
    assert torch.isnan(d[3, 32:64]).all() and torch.isfinite(d[3, :32]).all()
    assert torch.isfinite(b.scale).all()


def test_w8a8_block_recipe():
    q, s = random_mx_weight(200, 4160)
    x = random_act(6, 4160)
    w = mxgemm.prepare_weight(q, s, backend="emulation", recipe="w8a8-block")
    assert w.info["reencode"].elements == 200 * 4160
    xq, xs = quantize_1x128(x)
    bw = reencode_block128(q, s)
    ref = dequantize_1x128(xq, xs).double() @ bw.dequantize().double().T
    y = mxgemm.linear(x, w)
    assert sqnr_db(y, ref) > 45
    assert sqnr_db(y, x.double() @ _w_ref(q, s).T) > 25
