"""cublas_block and hybrid_sm90 on the H200: the activation quantizer bit for bit, GEMMs against their twins."""

import logging

import pytest
import torch
from helpers import (
    FP8_TENSOR_CORE_SUMS,
    FP32_SUMS,
    assert_within_ulp,
    exact_product,
    hybrid_operands,
    random_act,
    random_mx_weight,
    skip_unless_backend_runs,
    sqnr_db,
)

import mxgemm
from mxgemm.block128 import quantize_1x128
from mxgemm.kernels.cublaslt import blockwise_linear
from mxgemm.layouts import finish_output

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _blockwise_runs_here():
    skip_unless_backend_runs("cublas_block")


@pytest.mark.parametrize("m,k", [(1, 96), (3, 4160), (5, 128), (64, 14336), (4096, 4096), (130, 416)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_act_quant_bit_exact(m, k, dtype):
    from mxgemm.kernels.act_quant import quantize_1x128_padded

    x = random_act(m, k, dtype=dtype, device="cuda") * 5
    x[0, :7] = 0.0
    if m > 2:
        x[2] = 0.0  # an all-zero row
    q, s = quantize_1x128_padded(x)
    rq, rs = quantize_1x128(x)
    kb = rs.shape[1]
    assert torch.equal(q[:m, :k].view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s[:m, :kb], rs)
    assert int(q[m:].view(torch.uint8).sum()) == 0 and int(q[:, k:].view(torch.uint8).sum()) == 0
    assert s.stride() == (1, q.shape[0])


@pytest.mark.parametrize("m", [1, 3, 5, 4096])
@pytest.mark.parametrize("n", [130, 4160])
@pytest.mark.parametrize("k", [96, 4160, 14336])
def test_cublas_block_matches_twin(m, n, k):
    q, s = random_mx_weight(n, k, seed=m + n + k, device="cuda")
    x = random_act(m, k, seed=k, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    w = mxgemm.prepare_weight(q, s, backend="cublas_block")
    y = mxgemm.linear(x, w, bias)
    assert y.shape == (m, n) and y.is_contiguous()
    plain = mxgemm.linear(x, w)
    assert_within_ulp(plain, exact_product(*hybrid_operands(x, q, s, quantized=True)), sums=FP8_TENSOR_CORE_SUMS)
    assert torch.equal(y, plain + bias)  # cuBLASLt's bf16 output, then the bias in bf16
    assert sqnr_db(y, x.double() @ mxgemm.dequantize(mxgemm.MXTensor(q, s)).double().T + bias.double()) >= 25


@pytest.mark.parametrize("m", [1, 3, 5, 47, 48, 95, 96, 4096])
@pytest.mark.parametrize("n,k", [(130, 96), (4160, 4160), (4096, 14336), (28672, 4096)])
def test_hybrid_matches_twin(m, n, k):
    q, s = random_mx_weight(n, k, seed=m + n, device="cuda")
    x = random_act(m, k, seed=k + 1, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    y = mxgemm.linear(x, w)
    quantized = m >= w.info["crossover"]
    sums = FP8_TENSOR_CORE_SUMS if quantized else FP32_SUMS
    assert_within_ulp(y, exact_product(*hybrid_operands(x, q, s, quantized=quantized)), sums=sums)
    if not quantized:  # small M: exact w.r.t. the re-encoded weight, every output written
        from mxgemm.kernels.w8a16 import default_config, w8a16_linear

        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        w8a16_linear(
            x,
            w.tensors["qdata"][:n].view(torch.uint8),
            w.tensors["block_scale"],
            None,
            block_scaled=True,
            config=default_config(m, n, k, block_scaled=True),
            out=out,
        )
        assert torch.isfinite(out).all()


def test_hybrid_fp16_activations():
    q, s = random_mx_weight(4096, 4096, device="cuda")
    for m in (2, 256):
        x = random_act(m, 4096, dtype=torch.float16, device="cuda")
        w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
        y = mxgemm.linear(x, w)
        quantized = m >= w.info["crossover"]
        sums = FP8_TENSOR_CORE_SUMS if quantized else FP32_SUMS
        # fp16 activations: the exact regime's Triton kernel writes fp16; the quantized one bf16, then fp16
        assert y.dtype == torch.float16
        out = y.bfloat16() if quantized else y
        assert_within_ulp(out, exact_product(*hybrid_operands(x, q, s, quantized=quantized)), sums=sums, what=f"M={m}")


def test_auto_is_the_hybrid_and_keeps_inexact_layers_exact(caplog):
    q, s = random_mx_weight(512, 1024, device="cuda")
    assert mxgemm.prepare_weight(q, s).backend == "hybrid_sm90"
    s = s.clone()
    s[0] += 12  # outlier row: re-encoding would change its neighbours
    with caplog.at_level(logging.INFO, logger="mxgemm"):
        w = mxgemm.prepare_weight(q, s)
    assert w.backend == "triton" and "refused" in caplog.text
    with pytest.raises(mxgemm.BackendUnavailableError, match="MXGEMM_REENCODE_MAX_ERROR"):
        mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    assert mxgemm.prepare_weight(q, s, backend="cublas_block").info["reencode"].rel_error > 1e-5


def test_layer_with_hybrid_on_gpu():
    lin = torch.nn.Linear(4096, 6144, device="cuda", dtype=torch.bfloat16)
    layer = mxgemm.MXFP8Linear.from_linear(lin)
    assert layer.backend == "hybrid_sm90" and "recipe=hybrid-block128" in repr(layer)
    with torch.no_grad():
        for m in (1, 16, 300):
            x = random_act(m, 4096, device="cuda")
            assert sqnr_db(layer(x), lin(x)) >= 25


def test_gradients_flow_through_a_hybrid_layer():
    """The input's gradient through an MXFP8Linear on the GPU: the exact product with the dequantized weight, within
    bf16 rounding and fp32 sums; the weight stays frozen."""
    q, s = random_mx_weight(256, 512, device="cuda")
    layer = mxgemm.MXFP8Linear.from_quantized(q, s)
    assert layer.backend == "hybrid_sm90"
    for m in (1, 300):
        x = random_act(m, 512, seed=m, device="cuda").requires_grad_()
        grad_y = random_act(m, 256, seed=m + 1, device="cuda")
        layer(x).backward(grad_y)
        deq = mxgemm.dequantize(mxgemm.MXTensor(*layer.mx_weight()))
        assert_within_ulp(x.grad, exact_product(grad_y, deq.T), sums=FP32_SUMS, what=f"M={m}")
    assert not any(t.requires_grad for t in layer.prepared.tensors.values())


def test_planned_cublaslt_calls_match_the_twin_and_scaled_mm():
    """hybrid_sm90's cuBLASLt path is planned once per M (the CUDA quantizer and cublasLtMatmul in one call): within
    the FP8 tensor-core bound of the exact product, as torch._scaled_mm is, bf16 and fp16, with a bias, strided rows;
    the GEMM alone on the rows a call shares gives the call's bits; eager and graph-replayed calls give the same
    bits."""
    from mxgemm.kernels import cublaslt, fp8_gemm

    index = torch.cuda.current_device()
    status = cublaslt.plan_status(index, torch.cuda.get_device_capability(index))
    if not status:
        pytest.skip(status.reason)
    for m, n, k in [(300, 4096, 4096), (1000, 130, 416), (257, 28672, 4096), (4096, 4160, 14336)]:
        q, s = random_mx_weight(n, k, seed=m, device="cuda")
        w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
        assert w.info["blockwise_plan"]
        qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float16):
            x = random_act(m, k + 64, seed=k, dtype=dtype, device="cuda")[:, :k]  # rows of stride k + 64
            planned = cublaslt.linear_plan(qd, bs, n, k, m, dtype)
            y = planned(x, None)
            assert y.dtype == dtype and y.shape == (m, n) and y.is_contiguous()
            product = exact_product(*hybrid_operands(x, q, s, quantized=True))
            assert_within_ulp(y.bfloat16(), product, sums=FP8_TENSOR_CORE_SUMS, what=f"planned M={m} {dtype}")
            torch_path = blockwise_linear(x, qd, bs, n, None, quantize=fp8_gemm.quantize_1x128)
            assert_within_ulp(torch_path.bfloat16(), product, sums=FP8_TENSOR_CORE_SUMS, what=f"_scaled_mm M={m}")
            assert torch.equal(planned(x, bias), finish_output(planned(x, None).bfloat16(), x, bias, n))
            shared_y, rows = planned.sharing(x, bias)  # the call, and the quantized rows its buffer holds
            assert torch.equal(shared_y, planned(x, bias))
            assert torch.equal(planned.on_quantized(rows, x, None), planned(x, None))  # the GEMM alone on them
            with pytest.raises(ValueError, match="rows quantized for"):
                cublaslt.linear_plan(qd, bs, n, k, m + 16, dtype).on_quantized(rows, x, None)
        x = random_act(m, k, seed=1, device="cuda")
        eager = mxgemm.linear(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = mxgemm.linear(x, w)
        graph.replay()
        assert torch.equal(replayed, eager)
