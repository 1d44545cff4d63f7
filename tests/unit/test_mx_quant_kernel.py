"""The MX activation quantizer kernel: bit-exact to mxgemm.quantize, scales written straight into each layout."""

import os

import pytest
import torch

import mxgemm
from mxgemm import layouts

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("needs a GPU or the Triton interpreter", allow_module_level=True)


def _inputs(m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-30, 30, (m, 1), generator=g).float())
    x[0, :32] = 0.0  # an all-zero block
    if k >= 64:
        x[0, 32:64] = torch.tensor([2.0**i for i in range(-20, 12)])  # powers of two across binades
    if m > 1:
        x[1, :32] = 500.0 * torch.linspace(-1, 1, 32)  # saturates under floor
        x[1, 5] = 1e-30  # deep in the subnormal range of the block
    if m > 2:
        x[2, 3] = float("nan")
        if dtype == torch.float32 and k >= 64:  # the top of fp32's range: elements limited so as not to overflow
            x[2, 32:64] = torch.linspace(-3.4e38, 3.4e38, 32, dtype=torch.float64).float()
    finfo = torch.finfo(dtype)
    return x.clamp(-finfo.max, finfo.max).to(dtype).to(DEVICE)


# the interpreter is slow: the full matrix on small shapes there, everything on a GPU
SHAPES = [(1, 32), (3, 96), (17, 256)] + ([(130, 416), (17, 1024)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_bit_exact_to_quantize(m, k, dtype, elem_dtype, scale_mode):
    from mxgemm.kernels.mx_quant import mx_quantize

    x = _inputs(m, k, dtype, seed=m + k)
    ref = mxgemm.quantize(x, scale_mode=scale_mode, elem_dtype=elem_dtype)
    q, s = mx_quantize(x, scale_mode=scale_mode, elem_dtype=elem_dtype)
    assert torch.equal(s, ref.scale)
    nan = torch.isnan(ref.qdata.float())
    assert torch.equal(torch.isnan(q.float()), nan)  # NaN blocks: NaN elements (the sign of a NaN is not specified)
    assert torch.equal(q.view(torch.uint8)[~nan], ref.qdata.view(torch.uint8)[~nan])


@pytest.mark.parametrize("layout,swizzle", [("128x4", layouts.to_128x4), ("8x4", layouts.to_8x4)])
@pytest.mark.parametrize("m,k", [(5, 96), (130, 160), (8, 128)])
def test_scales_written_in_layout(layout, swizzle, m, k):
    from mxgemm.kernels.mx_quant import mx_quantize

    x = _inputs(m, k, torch.bfloat16)
    q, s = mx_quantize(x, layout=layout)
    ref = mxgemm.quantize(x)
    assert torch.equal(s, swizzle(ref.scale))  # padding bytes zero, as the plain-torch swizzle writes them
    q_row, _ = mx_quantize(x)
    assert torch.equal(q.view(torch.uint8), q_row.view(torch.uint8))


def test_every_e4m3_value_and_midpoint_rounds_like_torch():
    """All 126 positive finite E4M3 values, the midpoints between neighbours (ties to even) and just off them."""
    from mxgemm.kernels.mx_quant import mx_quantize

    vals = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float()  # 0 .. 448
    mids = (vals[:-1] + vals[1:]) / 2
    probe = torch.cat([vals, mids, mids * (1 + 2**-20), mids * (1 - 2**-20), -mids])
    probe = torch.cat([probe, torch.zeros(-probe.numel() % 32)]).reshape(-1, 32)
    probe[:, 0] = 448.0  # every block's amax is 448: scale 2^0, so elements convert as they are
    probe = probe.to(DEVICE)
    q, s = mx_quantize(probe)
    assert torch.equal(s, torch.full_like(s, 127))
    assert torch.equal(q.view(torch.uint8), probe.to(E4M3).view(torch.uint8))


def test_errors():
    from mxgemm.kernels.mx_quant import mx_quantize

    with pytest.raises(ValueError, match="multiple of 32"):
        mx_quantize(torch.zeros(2, 40, device=DEVICE))
    with pytest.raises(ValueError, match="unsupported layout"):
        mx_quantize(torch.zeros(2, 32, device=DEVICE), layout="4x4")


@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
def test_rceil_at_the_bottom_of_the_exponent_range(elem_dtype):
    """Blocks whose amax / max_elem falls among fp32's subnormals: rounded up to 2^-127 (code 0) only up to exactly
    2^-127, above it to 2^-126 (code 1), as the plain-torch rule does."""
    from mxgemm.kernels.mx_quant import mx_quantize

    max_elem = torch.finfo(elem_dtype).max
    amax = [max_elem * m * 2.0**e for e in range(-136, -119) for m in (1.0, 1.25, 1.5, 1.75)]
    x = torch.randn(len(amax), 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64).clamp(-1, 1)
    x[:, 7] = 1.0
    x = (x * torch.tensor(amax, dtype=torch.float64).unsqueeze(1)).float().to(DEVICE)
    ref = mxgemm.quantize(x, scale_mode="rceil", elem_dtype=elem_dtype)
    assert {0, 1} <= set(ref.scale.flatten().tolist())  # the boundary is among the probes
    q, s = mx_quantize(x, scale_mode="rceil", elem_dtype=elem_dtype)
    assert torch.equal(s, ref.scale)
    assert torch.equal(q.view(torch.uint8), ref.qdata.view(torch.uint8))
