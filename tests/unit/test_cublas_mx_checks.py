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
