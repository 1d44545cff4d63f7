"""quantize / dequantize: bit-exact against a plain float64 reference, edge cases, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mxgemm
from mxgemm.format import ELEM_DTYPES, e8m0_to_float32

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _floor_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2 v) for positive finite float64 v, via frexp (v = m * 2^e, m in [0.5, 1))."""
    _, e = torch.frexp(v)
    return e.to(torch.int64) - 1


def reference_quantize(x: torch.Tensor, scale_mode: str, elem_dtype: torch.dtype):
    """Plain float64 reference of the OCP FLOOR and NVIDIA RCEIL rules (independent of the bit tricks)."""
    max_elem, emax = ELEM_DTYPES[elem_dtype]
    blocks = x.double().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1)
    safe = torch.where((amax > 0) & torch.isfinite(amax), amax, torch.ones_like(amax))
    if scale_mode == "floor":
        # fp32 reads subnormal amax's exponent as -127: anything below 2^-126 clamps to -127 either way
        e = _floor_log2(safe) - emax
    else:
        descale = (amax.float() / max_elem).double()  # the rule divides in fp32
        safe_d = torch.where(descale > 0, descale, torch.ones_like(descale))
        m, ex = torch.frexp(safe_d)
        e = torch.where(m == 0.5, ex - 1, ex).to(torch.int64)
    e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp(-127, 127)
    biased = torch.where(torch.isfinite(amax), e + 127, torch.full_like(e, 255))
    scale_val = torch.where(biased == 255, math.nan, torch.pow(2.0, (biased - 127).double()))
    # the largest element whose value fits fp32 (found among all the format's values, not by formula)
    values = torch.arange(256, dtype=torch.uint8).view(elem_dtype).double()
    values = values[torch.isfinite(values) & (values >= 0)].sort().values
    fits = torch.finfo(torch.float32).max / torch.where(biased == 255, 1.0, scale_val)
    limit = values[(torch.searchsorted(values, fits, right=True) - 1).clamp(min=0)].clamp(max=max_elem)
    q = torch.minimum(torch.maximum(blocks / scale_val.unsqueeze(-1), -limit.unsqueeze(-1)), limit.unsqueeze(-1))
    return q.float().to(elem_dtype).reshape(x.shape), biased.to(torch.uint8)


def _assert_bits_equal(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    av, bv = a.view(torch.uint8), b.view(torch.uint8)
    if not torch.equal(av, bv):
        idx = (av != bv).nonzero()[0].tolist()
        raise AssertionError(f"first mismatch at {idx}: {av[tuple(idx)]:#x} vs {bv[tuple(idx)]:#x}")


def _edge_values(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    pieces = [
        torch.randn(32, generator=g),  # ordinary
        torch.zeros(32),  # all-zero block
        torch.randn(32, generator=g) * 1e-6,  # small
        torch.randn(32, generator=g) * 1e4,  # large
        torch.tensor([2.0**i for i in range(-16, 16)]),  # exact powers of two
        torch.tensor([448.0, 449.0, 500.0, -511.9] + [1.0] * 28),  # around the E4M3 max
        torch.full((32,), 3.0e-39),  # fp32 subnormal amax
        torch.randn(32, generator=g) * 1e30,  # huge
        torch.tensor([3.4e38, -3.3e38, 3.0e38, 2.5e38] + [1e38] * 28),  # fp32's top: must not dequantize to inf
        torch.tensor([-3.0e38] * 16 + [1.7e38] * 16),
        torch.tensor([2.0**127 * (1 + i / 32) for i in range(32)]),
    ]
    x = torch.cat(pieces)
    finfo = torch.finfo(dtype)
    x = x.clamp(-finfo.max, finfo.max).to(dtype)
    tiny = torch.tensor([finfo.tiny / 4] * 16 + [finfo.tiny] * 16, dtype=dtype)  # subnormals of the input dtype
    return torch.cat([x, tiny])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_quantize_bit_exact_edges(dtype, elem_dtype, scale_mode):
    x = _edge_values(dtype).reshape(-1, 96)
    t = mxgemm.quantize(x, scale_mode=scale_mode, elem_dtype=elem_dtype)
    q_ref, s_ref = reference_quantize(x, scale_mode, elem_dtype)
    _assert_bits_equal(t.scale, s_ref)
    _assert_bits_equal(t.qdata, q_ref)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    log_mag=st.floats(-40, 38),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    elem_dtype=st.sampled_from([E4M3, E5M2]),
    scale_mode=st.sampled_from(["floor", "rceil"]),
)
def test_quantize_bit_exact_random(seed, log_mag, dtype, elem_dtype, scale_mode):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 96, generator=g) * torch.exp2(torch.randn(3, 96, generator=g) * 4) * 10.0**log_mag
    finfo = torch.finfo(dtype)
    x = x.clamp(-finfo.max, finfo.max).to(dtype)
    t = mxgemm.quantize(x, scale_mode=scale_mode, elem_dtype=elem_dtype)
    q_ref, s_ref = reference_quantize(x, scale_mode, elem_dtype)
    _assert_bits_equal(t.scale, s_ref)
    _assert_bits_equal(t.qdata, q_ref)


def test_known_scales():
    x = torch.ones(1, 32)
    x[0, 0] = 500.0
    floor = mxgemm.quantize(x, scale_mode="floor")
    assert floor.scale.item() == 127  # floor(log2 500) - 8 = 0
    assert floor.qdata.float()[0, 0].item() == 448.0  # saturated
    rceil = mxgemm.quantize(x, scale_mode="rceil")
    assert rceil.scale.item() == 128  # 500 / 448 rounded up to 2
    assert rceil.qdata.float()[0, 0].item() == 256.0  # 250 rounds to the E4M3 grid (step 16 above 128)


def test_nan_inf_and_zero_blocks():
    x = torch.randn(4, 32)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[2] = 0.0
    for mode in ("floor", "rceil"):
        t = mxgemm.quantize(x, scale_mode=mode)
        assert t.scale[:2, 0].tolist() == [255, 255]
        d = mxgemm.dequantize(t)
        assert torch.isnan(d[:2]).all()
        assert torch.equal(d[2], torch.zeros(32))
        assert torch.isfinite(d[3]).all()


@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
def test_dequantize_exact(elem_dtype):
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(8, 64, generator=g) * 100).to(elem_dtype)
    s = torch.randint(0, 255, (8, 2), generator=g, dtype=torch.uint8)
    s[0, 0] = 0
    s[0, 1] = 254
    d = mxgemm.dequantize(mxgemm.MXTensor(q, s))
    ref = (q.double().reshape(8, 2, 32) * torch.pow(2.0, s.double() - 127).unsqueeze(-1)).reshape(8, 64).float()
    assert torch.equal(torch.isnan(d), torch.isnan(ref))
    assert torch.equal(d.nan_to_num(), ref.nan_to_num())
    assert mxgemm.dequantize(mxgemm.MXTensor(q, s), torch.bfloat16).dtype == torch.bfloat16


def test_e8m0_to_float32_all_codes():
    s = torch.arange(256, dtype=torch.uint8)
    v = e8m0_to_float32(s)
    assert torch.isnan(v[255])
    ref = torch.pow(2.0, torch.arange(255, dtype=torch.float64) - 127).float()
    assert torch.equal(v[:255], ref)
    assert v[0].item() == 2.0**-127


def test_round_trip_error_is_small():
    x = torch.randn(16, 256)
    for mode in ("floor", "rceil"):
        d = mxgemm.dequantize(mxgemm.quantize(x, scale_mode=mode))
        assert (d - x).norm() / x.norm() < 0.04  # E4M3: 3 mantissa bits


def test_leading_dims_kept():
    t = mxgemm.quantize(torch.randn(2, 3, 64))
    assert t.qdata.shape == (2, 3, 64) and t.scale.shape == (2, 3, 2)
    assert t.elem_dtype == E4M3 and t.shape == (2, 3, 64)


def test_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxgemm.quantize(torch.randn(4, 40))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        mxgemm.quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match="elem_dtype"):
        mxgemm.quantize(torch.randn(4, 32), elem_dtype=torch.float16)
    with pytest.raises(ValueError, match="scale_mode"):
        mxgemm.quantize(torch.randn(4, 32), scale_mode="ceil")
    q = torch.randn(4, 64).to(E4M3)
    with pytest.raises(ValueError, match=r"expected \(4, 2\)"):
        mxgemm.MXTensor(q, torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        mxgemm.MXTensor(q, torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="float8"):
        mxgemm.MXTensor(torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.uint8))


@pytest.mark.parametrize("elem_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
def test_finite_inputs_never_dequantize_to_inf(elem_dtype, scale_mode):
    """At the top of fp32's range: rceil's scale (2^120 for E4M3) would let the largest elements round up to 2^128."""
    top = torch.finfo(torch.float32).max
    x = torch.tensor([top, -top * 0.99, top * 0.9, top / 2] + [top / 4] * 28).reshape(1, 32)
    t = mxgemm.quantize(x, scale_mode=scale_mode, elem_dtype=elem_dtype)
    back = mxgemm.dequantize(t)
    assert torch.isfinite(back).all()
    assert ((back - x).abs() / x.abs()).max() <= 0.13  # the nearest values below fp32's max


_MBITS = {E4M3: 3, E5M2: 2}
_EMIN = {E4M3: -6, E5M2: -14}


@settings(max_examples=200, deadline=None)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=32, max_size=32),
    elem_dtype=st.sampled_from([E4M3, E5M2]),
    scale_mode=st.sampled_from(["floor", "rceil"]),
)
def test_round_trip_is_finite_and_within_half_a_step(values, elem_dtype, scale_mode):
    """Any finite fp32 block, fp32's extremes and subnormals included: the round trip is finite and each element
    lies within half a step of the element grid at the block's scale, or is clipped to the largest element (the
    floor rule's saturation, and the limit that keeps values below fp32's overflow)."""
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 32)
    t = mxgemm.quantize(x, scale_mode=scale_mode, elem_dtype=elem_dtype)
    back = mxgemm.dequantize(t).double()
    assert torch.isfinite(back).all()
    scale = 2.0 ** (int(t.scale) - 127)
    xd = x.double()
    # the grid step at |x|: 2^(floor(log2 |x/scale|) - mbits) * scale, never below the subnormal step
    mag = (xd.abs() / scale).clamp_min(2.0 ** _EMIN[elem_dtype])
    step = torch.exp2(torch.floor(torch.log2(mag)) - _MBITS[elem_dtype]) * scale
    largest = back.abs().max()
    clipped = (xd.abs() > largest) & (back.abs() == largest)
    assert (((back - xd).abs() <= step / 2 + 1e-300) | clipped).all()


def test_compressed_tensors_rule_writes_compressed_tensors_bytes():
    """Byte parity with compressed-tensors' own MXFP8 quantization (its qparams, quantize and scale compression) on
    bf16 weights, blocks whose largest magnitude has the mantissa 1.75 included (where it differs from rceil)."""
    pytest.importorskip("compressed_tensors")
    from helpers import compressed_tensors_mxfp8

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 1024, generator=g) * 0.02 * torch.exp2(torch.randn(256, 1, generator=g) * 3)).bfloat16()
    w[:8, :32] = (
        torch.tensor([1.75, -1.75, 1.875, 1.7421875, 448.0, -500.0, 3.5, 0.4375]).unsqueeze(1)
        * torch.linspace(1, 0.01, 32)
    ).bfloat16()
    q_ct, s_ct = compressed_tensors_mxfp8(w)
    t = mxgemm.quantize(w, scale_mode="compressed-tensors")
    _assert_bits_equal(t.scale, s_ct)
    _assert_bits_equal(t.qdata, q_ct)
    rceil = mxgemm.quantize(w, scale_mode="rceil")
    assert 0 < int((rceil.scale != t.scale).sum()) < 100  # only where the mantissa is exactly 1.75
    with pytest.raises(ValueError, match="E4M3"):
        mxgemm.quantize(w, scale_mode="compressed-tensors", elem_dtype=E5M2)


def test_mxfp8_is_described_once_and_read_from_its_description():
    """MX FP8 is a ``Format`` description (blocks of 32, E8M0 scales, E4M3 and E5M2 elements, its checkpoint names);
    the module's constants, pair checks and quantizer read it, and a checkpoint config is recognised by its names."""
    from mxgemm import checkpoints
    from mxgemm.format import BLOCK_SIZE, E8M0_BIAS, E8M0_NAN, ELEM_DTYPES, MXFP8, check_mx_pair

    assert (BLOCK_SIZE, E8M0_BIAS, E8M0_NAN) == (MXFP8.block_size, MXFP8.scale_bias, MXFP8.scale_nan) == (32, 127, 255)
    assert ELEM_DTYPES == {e.dtype: (e.max, e.emax) for e in MXFP8.elements}
    assert MXFP8.element(torch.float8_e5m2).mantissa_bits == 2 and MXFP8.element(torch.float8_e4m3fn).max == 448.0
    with pytest.raises(TypeError, match=r"MXFP8 elements must be float8_e4m3fn or float8_e5m2, got torch\.int8"):
        MXFP8.element(torch.int8)
    q, s = torch.zeros(2, 64, dtype=torch.float8_e4m3fn), torch.zeros(2, 2, dtype=torch.uint8)
    check_mx_pair(q, s)
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        check_mx_pair(q, s[:, :1])
    with pytest.raises(TypeError, match="MXFP8 scales must be uint8"):
        check_mx_pair(q, s.float())
    config = checkpoints.compressed_tensors_config("MXFP8", [])
    assert config["format"] == MXFP8.compressed_tensors == "mxfp8-quantized"
    assert config["config_groups"]["group_0"]["weights"]["group_size"] == MXFP8.block_size
