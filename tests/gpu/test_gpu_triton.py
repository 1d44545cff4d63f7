"""The ``triton`` backend on a real GPU against its emulated twin: odd and large shapes, poisoned outputs."""

import pytest
import torch
from helpers import assert_within_ulp, exact_product, random_act, random_mx_weight, skip_unless_backend_runs, sqnr_db

import mxgemm
from mxgemm.backends.emulation import emulate_linear

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _triton_runs_here():
    skip_unless_backend_runs("triton")


def _ref(x, q, s, bias):
    w = mxgemm.dequantize(mxgemm.MXTensor(q, s)).double()
    return x.double() @ w.T + (0 if bias is None else bias.double())


@pytest.mark.parametrize("m", [1, 3, 5, 64, 4096])
@pytest.mark.parametrize("n", [130, 4160])
@pytest.mark.parametrize("k", [96, 4160, 14336])
def test_matches_twin(m, n, k):
    q, s = random_mx_weight(n, k, seed=m * 7 + n + k, device="cuda")
    x = random_act(m, k, seed=m + k, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    w = mxgemm.prepare_weight(q, s, backend="triton")
    from mxgemm.kernels.w8a16 import w8a16_linear

    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = w8a16_linear(x, w.tensors["qdata"].view(torch.uint8), w.tensors["scale"], bias, out=out)
    assert torch.isfinite(y).all(), "some output elements were not written"
    assert_within_ulp(y, exact_product(x.float(), _weight(q, s), bias), what="w8a16 kernel")


def _weight(q, s):
    return mxgemm.dequantize(mxgemm.MXTensor(q, s))


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (3, 130, 96), (300, 4160, 4160)])
def test_fp16_activations(m, n, k):
    q, s = random_mx_weight(n, k, device="cuda")
    x = random_act(m, k, dtype=torch.float16, device="cuda")
    y = mxgemm.linear(x, mxgemm.prepare_weight(q, s, backend="triton"))
    assert y.dtype == torch.float16
    assert_within_ulp(y, exact_product(x.float(), _weight(q, s)), what="fp16 activations")


def test_layer_on_gpu_with_triton_and_moves():
    lin = torch.nn.Linear(4096, 1024, device="cuda", dtype=torch.bfloat16)
    layer = mxgemm.MXFP8Linear.from_linear(lin, backend="triton")
    assert layer.backend == "triton"
    x = random_act(16, 4096, device="cuda").reshape(2, 8, 4096)
    with torch.no_grad():
        assert sqnr_db(layer(x), lin(x)) >= 25
    with pytest.raises(mxgemm.BackendUnavailableError, match="triton"):
        layer.to("cpu")  # a named backend that cannot run on the new device says so
    auto = mxgemm.MXFP8Linear.from_linear(lin).to("cpu")  # auto re-resolves for the new device
    assert auto.backend == "emulation"


def test_e5m2_and_nan_blocks():
    q, s = random_mx_weight(256, 512, device="cuda", elem_dtype=torch.float8_e5m2)
    s = s.clone()
    s[7, 3] = 255
    x = random_act(9, 512, device="cuda")
    y = mxgemm.linear(x, mxgemm.prepare_weight(q, s, backend="triton"))
    assert torch.isnan(y[:, 7]).all()
    keep = torch.ones(256, dtype=torch.bool, device="cuda")
    keep[7] = False
    assert sqnr_db(y[:, keep], _ref(x, q, s, None)[:, keep]) >= 50


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tile", ["small", "large"])
@pytest.mark.parametrize("plain", [False, True])
def test_decode_is_exact_for_every_code(packed, tile, plain):
    """Identity activations make y = W^T: every finite E4M3 code under scales 2^-117..2^7 must come out bit-exact.

    Scales start at 10 so that every value is a normal bf16: tensor cores need not keep subnormal operands.
    """
    from mxgemm.kernels.w8a16 import W8A16Config, w8a16_linear

    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F]  # 254 finite codes (NaN handled at preparation)
    k = 256
    row = torch.cat([codes, torch.zeros(k - codes.numel(), dtype=torch.int32)]).to(torch.uint8)
    scales = torch.arange(10, 135, dtype=torch.uint8)
    n = scales.numel()
    g = torch.Generator().manual_seed(int(packed) + 2 * int(plain))
    w = torch.stack([row[torch.randperm(k, generator=g)] for _ in range(n)]).cuda()
    s = scales.repeat_interleave(k // 32).reshape(n, k // 32).cuda()
    s = s.roll(1, dims=1)  # blocks of one row differ by a little too
    x = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    cfg = {
        "small": W8A16Config(bn=64, bm=16, bk=256, split_k=2, packed=packed, warps=4, stages=3),
        "large": W8A16Config(bn=128, bm=128, bk=64, split_k=1, packed=packed, warps=8, stages=3),
    }[tile]
    y = w8a16_linear(x, w, s, None, plain_scales=plain, config=cfg)
    ref = mxgemm.dequantize(mxgemm.MXTensor(w.view(torch.float8_e4m3fn), s), torch.bfloat16)
    assert torch.equal(y.T.float(), ref.float())  # values: -0.0 from code 0x80 sums to +0.0


@pytest.mark.parametrize("m", [1, 48, 300, 4096])
def test_backend_fast_paths_match_twin(m):
    """Through the backend: plain-scale decode for small M, the packed decoder for large M."""
    q, s = random_mx_weight(4160, 4160, seed=m, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="triton")
    assert w.info == {"plain_scales": True, "packed_decode": True}
    x = random_act(m, 4160, device="cuda")
    assert_within_ulp(mxgemm.linear(x, w), exact_product(x.float(), _weight(q, s)), what=f"M={m}")


@pytest.mark.parametrize("m", [256, 4096])
@pytest.mark.parametrize("n,k", [(130, 96), (4160, 4160), (4096, 14336)])
@pytest.mark.parametrize("chunk", [None, 1])
def test_dequant_path_matches_twin(m, n, k, chunk):
    """From M = 256 (bf16) the weight is dequantized for cuBLAS; in 128-row chunks (chunk=1) cuBLAS writes column
    slices of the output in place."""
    from mxgemm.kernels.dequant import dequant_linear

    q, s = random_mx_weight(n, k, seed=m + n + k, device="cuda")
    x = random_act(m, k, seed=m + k, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    w = mxgemm.prepare_weight(q, s, backend="triton")
    if chunk is None:
        y = mxgemm.linear(x, w, bias)
    else:
        y = dequant_linear(x, q.view(torch.uint8), w.tensors["scale"], bias, max_chunk_bytes=chunk)
    assert torch.isfinite(y).all(), "some output elements were not written"
    assert sqnr_db(y, _ref(x, q, s, bias)) >= 50
    twin = emulate_linear(x, mxgemm.prepare_weight(q, s, backend="emulation"), bias).float()
    assert (y.float() - twin).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * twin.abs().max()
