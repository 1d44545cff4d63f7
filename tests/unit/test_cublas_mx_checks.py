"""`cublas_mx`'s call held against PyTorch's own checks for 1x32 block scaling, on CPU: the backend's
`torch._scaled_mm` call runs through PyTorch's meta implementation (operand dtypes and alignment, the E8M0 scales'
dtype and their 128x4-padded element counts), then a stand-in computes the documented product from the same operands
for a comparison with the emulated twin."""

import pytest
import torch
from helpers import random_act, random_mx_weight

import mxgemm
from mxgemm.layouts import from_128x4

if not hasattr(torch, "float8_e8m0fnu"):
    pytest.skip("this torch has no float8_e8m0fnu", allow_module_level=True)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.fixture
def checked_scaled_mm(monkeypatch):
    """torch._scaled_mm as the backend calls it: PyTorch's meta checks first, then the product in fp32."""
    real = torch._scaled_mm

    def scaled_mm(a, b, scale_a, scale_b, *args, out_dtype=None, **kwargs):
        assert not args and not kwargs, (args, kwargs)
        meta = real(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b), out_dtype=out_dtype)
        m, k = a.shape
        n = b.shape[1]
        sa = from_128x4(scale_a.view(torch.uint8), m, k // 32)
        sb = from_128x4(scale_b.view(torch.uint8), n, k // 32)
        deq = lambda q, s: mxgemm.dequantize(mxgemm.MXTensor(q.contiguous(), s))  # noqa: E731
        y = (deq(a, sa) @ deq(b.t(), sb).t()).to(out_dtype)
        assert meta.shape == y.shape and meta.dtype == y.dtype
        return y

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("n,k", [(256, 512), (130, 512), (144, 96), (4160, 4160)])
@pytest.mark.parametrize("m", [1, 5, 130])
def test_cublas_mx_call_passes_pytorchs_checks_and_matches_the_twin(checked_scaled_mm, m, n, k):
    q, s = random_mx_weight(n, k, seed=n)
    backend = mxgemm.backends.get_backend("cublas_mx")
    w = backend.prepare(q, s.view(torch.float8_e8m0fnu), "w8a8-mx")  # E8M0-typed scales are taken as uint8 ones
    x = random_act(m, k, seed=m)
    y = backend.run(x, w, None)
    twin = mxgemm.backends.get_backend("emulation")
    ref = twin.run(x, twin.prepare(q, s, "w8a8-mx"), None)
    assert y.shape == (m, n) and torch.allclose(y.float(), ref.float(), rtol=2**-7, atol=0)
    exported = backend.export_mx(w)
    assert torch.equal(exported[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(exported[1], s)


def test_pytorch_refuses_what_the_backend_pads_away():
    """The checks the padding answers to: PyTorch's meta implementation refuses N = 130 unpadded."""
    a = torch.empty(5, 512, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(130, 512, dtype=torch.float8_e4m3fn, device="meta")
    scale = torch.empty(128 * 16, dtype=torch.float8_e8m0fnu, device="meta")
    scale_b = torch.empty(256 * 16, dtype=torch.float8_e8m0fnu, device="meta")
    with pytest.raises(RuntimeError, match="divisible by 16"):
        torch._scaled_mm(a, b.t(), scale, scale_b, out_dtype=torch.bfloat16)


def test_grouped_scales_are_pytorchs_per_group_blocked_layout():
    """The activations' scales of rows sorted by expert, as PyTorch's own MXFP8 grouped GEMM test lays them out: each
    group's scales through PyTorch's `to_blocked`, concatenated; rows past the last group's end left out."""
    from torch.testing._internal.common_quantized import to_blocked

    from mxgemm.layouts import grouped_128x4

    g = torch.Generator().manual_seed(0)
    scale = torch.randint(0, 255, (400, 8), generator=g, dtype=torch.uint8)
    counts = [3, 0, 200, 1, 130]  # 66 rows past the end
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    out = grouped_128x4(scale, offsets)
    assert out.shape == (512 + 128 * 5, 8)
    expected, start = [], 0
    for c in counts:
        if c:
            expected.append(to_blocked(scale[start : start + c].view(torch.float8_e8m0fnu)).view(torch.uint8))
        start += c
    expected = torch.cat(expected)
    assert torch.equal(out.reshape(-1)[: expected.numel()], expected)
    assert not out.reshape(-1)[expected.numel() :].any()


def _dequantized(q, flat_scale, rows, k):
    scale = from_128x4(flat_scale.view(torch.uint8).reshape(-1), rows, k // 32)
    return mxgemm.dequantize(mxgemm.MXTensor(q.contiguous(), scale))


@pytest.fixture
def checked_scaled_grouped_mm(monkeypatch):
    """torch._scaled_grouped_mm as the backend calls it: PyTorch's meta checks first, then each group's product in
    fp32 with its scales read where FBGEMM's kernel reads them (group g's activation scales from row
    sum(round_up(M_j, 128) for j < g) of scale_a, expert g's from row g of scale_b); rows past the last group's end
    are left unwritten (NaN here)."""
    real = torch._scaled_grouped_mm

    def scaled_grouped_mm(a, b, scale_a, scale_b, *, offs, out_dtype):
        meta = real(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b), offs=_meta(offs), out_dtype=out_dtype)
        s, k = a.shape
        n = b.shape[2]
        y = torch.full((s, n), float("nan"))
        start, first = 0, 0
        for g, end in enumerate(offs.tolist()):
            rows = end - start
            if rows > 0:
                padded = -(-rows // 128) * 128
                xs = scale_a.view(torch.uint8).reshape(-1)[first * (k // 32) : (first + padded) * (k // 32)]
                w = _dequantized(b[g].t(), scale_b[g], n, k)
                y[start:end] = _dequantized(a[start:end], xs, rows, k) @ w.t()
                first += padded
            start = end
        y = y.to(out_dtype)
        assert meta.shape == y.shape and meta.dtype == y.dtype
        return y

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm)
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("n,k", [(256, 512), (130, 256)])
@pytest.mark.parametrize("counts", [[3, 0, 200, 1], [0, 0, 0, 40], [1, 1, 1, 1]])
def test_cublas_mx_grouped_call_passes_pytorchs_checks_and_matches_the_twin(checked_scaled_grouped_mm, n, k, counts):
    """Uneven rows, empty experts, every row on one expert, rows past the last expert (zeros): within the twin's
    rounding, and the experts exported as they came."""
    pairs = [random_mx_weight(n, k, seed=n + i) for i in range(4)]
    q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    backend = mxgemm.backends.get_backend("cublas_mx")
    w = backend.prepare_grouped(q, s.view(torch.float8_e8m0fnu), "w8a8-mx")
    x = random_act(sum(counts) + 5, k, seed=sum(counts))
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    y = backend.run_grouped(x, w, offsets)
    twin = mxgemm.backends.get_backend("emulation")
    ref = twin.run_grouped(x, twin.prepare_grouped(q, s, "w8a8-mx"), offsets)
    assert y.shape == (x.shape[0], n) and torch.equal(y[-5:], torch.zeros_like(y[-5:]))
    assert torch.allclose(y.float(), ref.float(), rtol=2**-7, atol=0)
    exported = backend.export_grouped_mx(w)
    assert torch.equal(exported[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(exported[1], s)


def test_cublas_mx_grouped_refusals_say_why():
    import mxgemm.backends.base as base

    backend = mxgemm.backends.get_backend("cublas_mx")
    q, s = random_mx_weight(64, 96)
    with pytest.raises(base.UnsupportedWeightError, match="multiples of 128; K = 96"):
        backend.prepare_grouped(q[None], s[None], "w8a8-mx")
    hopper = mxgemm.DeviceInfo(type="cuda", name="NVIDIA H200", capability=(9, 0), index=0)
    assert "SM100" in backend.check_grouped(hopper).reason
