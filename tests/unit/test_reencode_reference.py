"""The 128x128 re-encoding against an independent reference (one block at a time, float64), bit for bit, and the
rceil scale rule at the bottom of the exponent range."""

import pytest
import torch
from test_format import reference_quantize

import mxgemm
from mxgemm.block128 import reencode_block128


def reference_reencode(q: torch.Tensor, s: torch.Tensor):
    """Block by block: the block's scale is the largest finite E8M0 code of its 32-blocks; each element becomes
    q * 2^(s - E) rounded to E4M3 (a NaN code keeps its elements NaN). Returns (e4m3 [N, K], codes [nb, kb])."""
    n, k = q.shape
    out = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    codes = torch.empty(-(-n // 128), -(-k // 128), dtype=torch.int64)
    for bi in range(codes.shape[0]):
        for bj in range(codes.shape[1]):
            rows, cols = slice(128 * bi, 128 * bi + 128), slice(128 * bj, 128 * bj + 128)
            sb = s[rows, 4 * bj : 4 * bj + 4].long()
            finite = sb[sb != 255]
            e = int(finite.max()) if finite.numel() else 0
            codes[bi, bj] = e
            qb = q[rows, cols].double()
            factor = torch.pow(2.0, (sb - e).double()).repeat_interleave(32, dim=1)[:, : qb.shape[1]]
            moved = torch.where(sb.repeat_interleave(32, dim=1)[:, : qb.shape[1]] == 255, float("nan"), qb * factor)
            out[rows, cols] = moved.float().to(torch.float8_e4m3fn)
    return out, codes


@pytest.mark.parametrize("n,k,spread", [(128, 128, 0), (200, 608, 3), (300, 1024, 12), (130, 96, 30)])
def test_reencoding_matches_the_block_by_block_reference(n, k, spread):
    g = torch.Generator().manual_seed(n + k)
    q = (torch.randn(n, k, generator=g) * 60).to(torch.float8_e4m3fn)
    s = torch.randint(-spread, 1, (n, k // 32), generator=g, dtype=torch.int64)
    rows, cols = torch.arange(n).unsqueeze(1) // 128, torch.arange(k // 32).unsqueeze(0) // 4
    s = (s + 110 + 3 * rows + 5 * cols).to(torch.uint8)  # every 128x128 block its own largest exponent
    if spread:
        s[5, 1] = 255  # a NaN block
    block = reencode_block128(q, s)
    ref_q, ref_codes = reference_reencode(q, s)
    got, want = block.qdata.view(torch.uint8), ref_q.view(torch.uint8)
    nan = torch.isnan(ref_q.float())
    assert torch.equal(torch.isnan(block.qdata.float()), nan)
    assert torch.equal(got[~nan], want[~nan])
    assert torch.equal(block.scale, torch.pow(2.0, (ref_codes - 127).double()).float())
    old = mxgemm.dequantize(mxgemm.MXTensor(q, s)).double()
    new = (
        ref_q.double()
        * torch.pow(2.0, (ref_codes - 127).double()).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    )
    finite = torch.isfinite(old)
    assert block.report.changed == int((finite & (old != new)).sum())
    if spread >= 12:  # shifts of up to 12 push small elements into E4M3's subnormals
        assert block.report.changed > 0


@pytest.mark.parametrize("elem_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rceil_at_the_bottom_of_the_exponent_range(elem_dtype):
    """amax / max_elem at, just above and just below 2^-127 (an fp32 subnormal whose mantissa is 0x400000), 2^-126
    and 2^-128: each rounds up to the right power of two, as the float64 reference says."""
    max_elem = 448.0 if elem_dtype == torch.float8_e4m3fn else 57344.0
    steps = range(-8, 9)  # amax = max_elem * 2^p * (1 + j 2^-20): descale moves by 4 subnormal steps per j
    amax = torch.tensor([max_elem * 2.0**p * (1 + j * 2.0**-20) for p in (-128, -127, -126) for j in steps])
    x = amax.float().unsqueeze(1) * torch.linspace(1, 0.1, 32)  # amax first in each block
    t = mxgemm.quantize(x, scale_mode="rceil", elem_dtype=elem_dtype)
    q_ref, s_ref = reference_quantize(x, "rceil", elem_dtype)
    assert torch.equal(t.scale, s_ref)
    assert torch.equal(t.qdata.view(torch.uint8), q_ref.view(torch.uint8))
    centre = len(steps) + 8  # max_elem * 2^-127 exactly: descale 2^-127 (mantissa 0x400000) keeps code 0
    codes = t.scale[:, 0].tolist()
    assert codes[centre - 1 : centre + 2] == [0, 0, 1] and codes[-1] == 2 and codes[0] == 0


def test_chunks_of_rows_keep_whole_128_row_groups(monkeypatch):
    """The re-encoding works through chunks of rows (``_CHUNK_ELEMENTS``); with chunks far smaller than the weight
    and K not a multiple of 128, every chunk still holds whole 128-row groups: the block-by-block reference's bits."""
    from mxgemm import block128

    n, k = 300, 160
    monkeypatch.setattr(block128, "_CHUNK_ELEMENTS", k * 130)  # about 130 rows a chunk
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(n, k, generator=g) * 60).to(torch.float8_e4m3fn)
    s = (torch.randint(100, 127, (n, k // 32), generator=g)).to(torch.uint8)
    out, codes = reference_reencode(q, s)
    block = reencode_block128(q, s)
    assert torch.equal(block.qdata.view(torch.uint8), out.view(torch.uint8))
    assert torch.equal(block.scale, torch.exp2(codes.float() - 127))
