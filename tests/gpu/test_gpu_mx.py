"""Blackwell MX backends against their w8a8-mx emulated twin; each skips with its own reason where it cannot run."""

import pytest
import torch
from helpers import random_act, random_mx_weight, skip_unless_backend_runs, sqnr_db

import mxgemm
from mxgemm.backends.emulation import emulate_linear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "name", ["flashinfer_cutedsl", "flashinfer_cutlass", "flashinfer_trtllm", "flashinfer_cudnn", "cublas_mx"]
)
@pytest.mark.parametrize("m,n,k", [(1, 130, 256), (7, 256, 512), (128, 130, 768), (4096, 4096, 4096)])
def test_matches_the_w8a8_mx_twin(name, m, n, k):
    skip_unless_backend_runs(name)
    q, s = random_mx_weight(n, k, device="cuda")
    x = random_act(m, k, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend=name)
    y = mxgemm.linear(x, w)
    assert y.shape == (m, n) and y.is_contiguous() and torch.isfinite(y).all()
    twin = emulate_linear(x, mxgemm.prepare_weight(q, s, backend="emulation", recipe="w8a8-mx"), None)
    assert sqnr_db(y, twin) >= 45


@pytest.mark.parametrize("name", ["cublas_mx", "flashinfer_cudnn"])
@pytest.mark.parametrize("n,k,counts", [(256, 512, [3, 0, 137, 10]), (130, 256, [1, 1, 1, 1]), (4096, 2048, [900] * 8)])
def test_grouped_matches_the_w8a8_mx_twin(name, n, k, counts):
    """Experts through the Blackwell grouped GEMMs (uneven rows, an empty expert, rows past the last expert's end)."""
    skip_unless_backend_runs(name)
    device = mxgemm.describe_device()
    answer = mxgemm.backends.get_backend(name).check_grouped(device)
    if not answer:
        pytest.skip(answer.reason)
    experts = len(counts)
    q, s = random_mx_weight(experts * n, k, device="cuda")
    q, s = q.view(experts, n, k), s.view(experts, n, k // 32)
    offsets = torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)
    x = random_act(sum(counts) + 5, k, device="cuda")
    y = mxgemm.grouped_linear(x, mxgemm.prepare_grouped_weight(q, s, backend=name), offsets)
    twin = mxgemm.grouped_linear(x, mxgemm.prepare_grouped_weight(q, s, backend="emulation", recipe="w8a8-mx"), offsets)
    assert y.shape == (x.shape[0], n) and torch.isfinite(y).all()
    assert torch.equal(y[sum(counts) :], torch.zeros_like(y[sum(counts) :]))
    assert sqnr_db(y, twin) >= 45


def test_mx_quantizer_is_bit_exact_on_this_gpu():
    """The activation quantizer these backends use, on the GPU in hand (the H200 included)."""
    skip_unless_backend_runs("triton")
    from mxgemm.kernels.mx_quant import mx_quantize

    for mode in ("floor", "rceil"):
        x = random_act(300, 4096, device="cuda") * 7
        q, s = mx_quantize(x, scale_mode=mode, layout="128x4")
        ref = mxgemm.quantize(x, scale_mode=mode)
        assert torch.equal(q.view(torch.uint8), ref.qdata.view(torch.uint8))
        assert torch.equal(s, mxgemm.layouts.to_128x4(ref.scale))
