"""The FP8 wgmma kernel (sm_90a) on the GPU: every config against the quantized twin of hybrid_sm90's upper regime
(activations 1x128-quantized, the weight re-encoded to 128x128 blocks), element by element, on odd and large shapes;
outputs poisoned beforehand are fully written."""

import itertools

import pytest
import torch
from helpers import (
    FP8_TENSOR_CORE_SUMS,
    assert_within_ulp,
    exact_product,
    hybrid_operands,
    kernels_launched,
    random_act,
    random_mx_weight,
    skip_unless_backend_runs,
)

import mxgemm
from mxgemm.backends.hybrid_sm90 import Path, fp8_default
from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.act_quant import quantize_1x128_padded
from mxgemm.kernels.fp8_gemm import SwapAB, TokensAsM

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    skip_unless_backend_runs("hybrid_sm90")
    status = fp8_gemm.fp8_gemm_status(torch.cuda.get_device_capability())
    if not status:
        pytest.skip(status.reason)


def _configs(kp: int) -> list[fp8_gemm.Fp8Config]:
    swap = [
        SwapAB(tn, rw, kc, splits, st)
        for tn, (rw, kc), splits, st in itertools.product(
            fp8_gemm.TOKEN_TILES, ((1, 1), (2, 1), (1, 2)), (1, 2, 4, 8), fp8_gemm.STAGES
        )
    ]
    tokm = [TokensAsM(*c) for c in itertools.product((64, 128), (64, 128), (1, 2, 4, 8), fp8_gemm.STAGES)]
    return [c for c in swap + tokm if c.valid(kp)]


def _quantized(x, q, s):
    return hybrid_operands(x, q, s, quantized=True)


@pytest.mark.parametrize("m", [1, 3, 5, 64, 100, 256])
@pytest.mark.parametrize("n,k", [(130, 96), (4160, 4160), (4096, 14336)])  # 4, 36 (9 a split with 4), 112 K blocks
def test_every_config_matches_the_twin(m, n, k):
    q, s = random_mx_weight(n, k, seed=n + m, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    x = random_act(m, k, seed=k + m, device="cuda")
    product = exact_product(*_quantized(x, q, s))
    xq, xs = quantize_1x128_padded(x)
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    for cfg in _configs(qd.shape[1]):
        y = fp8_gemm.fp8_gemm(xq, xs, m, qd, bs, n, cfg)
        assert y.shape == (m, n)
        assert_within_ulp(y, product, sums=FP8_TENSOR_CORE_SUMS, what=str(cfg))


@pytest.mark.parametrize("m", [1, 5, 64, 100, 256])
@pytest.mark.parametrize("n,k", [(130, 96), (4160, 4608), (4096, 14336)])
def test_every_fp8_tactic_of_the_backend_matches_the_twin(m, n, k):
    """hybrid_sm90's FP8 tactics (and cuBLASLt's) in the quantized regime, through the backend (bias, fp16 too)."""
    q, s = random_mx_weight(n, k, seed=n + m, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    b = mxgemm.backends.get_backend("hybrid_sm90")
    assert "fp8_sms" in w.info
    w.info["crossover"] = 1  # every M in the quantized regime
    x = random_act(m, k, seed=k + m, device="cuda")
    bias = torch.randn(n, device="cuda").bfloat16()
    xe, we = _quantized(x, q, s)
    product, biased = exact_product(xe, we), exact_product(xe, we, bias)
    tactics = b.tactics(m, w)
    # the default: our kernel up to M = 128 on these weights (at most 65 CTAs of 64 rows: one wave)
    assert sum(t.path == Path.FP8 for t in tactics) > 8 and tactics[0].path == (Path.FP8 if m <= 128 else "cublas")
    for tactic in tactics:
        y = b.run(x, w, bias, tactic=tactic)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        if tactic.path == Path.FP8:  # the bias in the kernel's epilogue: one rounding
            assert_within_ulp(y, biased, sums=FP8_TENSOR_CORE_SUMS, what=str(tactic))
        else:  # cuBLASLt's bf16 output, then the bias in bf16
            plain = b.run(x, w, None, tactic=tactic)
            assert_within_ulp(plain, product, sums=FP8_TENSOR_CORE_SUMS, what=str(tactic))
            assert torch.equal(y, plain + bias)
    y16 = b.run(x.half(), w, None, tactic=tactics[0])  # bf16 out of the kernel, then fp16: two roundings
    assert y16.dtype == torch.float16
    assert_within_ulp(
        y16.bfloat16(), exact_product(*_quantized(x.half(), q, s)), sums=FP8_TENSOR_CORE_SUMS, what="fp16"
    )


def test_poisoned_output_is_fully_written():
    q, s = random_mx_weight(4160, 4608, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    x = random_act(100, 4608, device="cuda")
    xq, xs = quantize_1x128_padded(x)
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    configs = (
        SwapAB(64, rw=2, splits=4, stages=2),
        SwapAB(32, splits=1, stages=6),
        SwapAB(8, splits=2, stages=4),
        SwapAB(128, kc=2, splits=2, stages=2),
        SwapAB(16, kc=2, splits=1, stages=6),
        TokensAsM(128, 128, splits=2, stages=4),
        TokensAsM(64, 64, splits=1, stages=6),
        TokensAsM(64, 128, splits=4, stages=2),
    )
    for cfg in configs:
        out = torch.full((100, 4160), float("nan"), device="cuda", dtype=torch.bfloat16)
        fp8_gemm.fp8_gemm(xq, xs, 100, qd, bs, 4160, cfg, out=out)
        assert torch.isfinite(out).all(), cfg


def test_rows_off_alignment_and_fp16_rows_give_the_contiguous_bf16_calls_bits():
    """Rows that start 2 bytes off 16-byte alignment give the bits of the same rows copied contiguous, and fp16 rows
    run (the quantizer reads both)."""
    q, s = random_mx_weight(512, 256, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    cfg = SwapAB(32, splits=1, stages=2)
    x = random_act(20, 256 + 1, device="cuda")[:, 1:]
    assert torch.equal(fp8_gemm.fp8_linear(x, qd, bs, 512, cfg), fp8_gemm.fp8_linear(x.contiguous(), qd, bs, 512, cfg))
    y16 = fp8_gemm.fp8_linear(x.contiguous().half(), qd, bs, 512, cfg)
    assert torch.isfinite(y16).all()


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (24, 6144, 4096), (64, 4096, 14336), (100, 130, 416)])
def test_graphed_plans_give_the_direct_launches_bits_call_after_call(m, n, k):
    """A graphed plan launches the quantizer and the GEMM as one CUDA graph, each call's pointers, strides and bias
    set into its nodes: the bits of direct launches, call after call on fresh tensors, bf16 and fp16; under capture
    it launches directly."""
    q, s = random_mx_weight(n, k, seed=m, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    cfg = fp8_default(m, *qd.shape, torch.cuda.get_device_properties(0).multi_processor_count)
    graphed = fp8_gemm.linear_plan(qd, bs, n, k, m, cfg)
    direct = fp8_gemm.linear_plan(qd, bs, n, k, m, cfg, graphed=False)
    for i in range(4):  # rows 8 * i elements apart beyond k: each call's activations and row stride are new
        x = random_act(m, k + 8 * i, seed=i, device="cuda")[:, :k]
        bias = torch.randn(n, device="cuda").bfloat16() if i % 2 else None
        assert torch.equal(graphed(x, bias), direct(x, bias)), i
        x16 = x.half()
        assert torch.equal(graphed(x16, None), direct(x16, None)), i
    names = kernels_launched(lambda: graphed(x, None))
    assert len(names) == 2 and any("quant_1x128" in n for n in names), names
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = graphed(x, None)
    graph.replay()
    assert torch.equal(captured, direct(x, None))


@pytest.mark.parametrize("m", [16, 64, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_calls_give_the_plain_calls_bits_on_the_product(m, dtype):
    """A plan's ``.gated`` (the gated quantizer, then the GEMM) == the plain call on ``silu(gate) * up`` as PyTorch
    computes it, bit for bit, on column views of one [M, 2K] output as a joined gate/up GEMM gives them, with and
    without a bias, for plans of both launch kinds (graphed, direct), call after call on fresh inputs and
    alternating with plain calls on the same plan; under capture it launches the two kernels."""
    n, k = 1024, 3584
    q, s = random_mx_weight(n, k, seed=m, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    configs = {fp8_default(m, *qd.shape, sms), SwapAB(16, splits=2, stages=4), TokensAsM(64, 64, splits=2, stages=4)}
    direct = {cfg: fp8_gemm.linear_plan(qd, bs, n, k, m, cfg, graphed=False) for cfg in configs}
    for cfg, graphed in itertools.product(configs, (True, False)):
        plan = fp8_gemm.linear_plan(qd, bs, n, k, m, cfg, graphed)
        for i in range(3):
            both = random_act(m, 2 * k, seed=i, dtype=dtype, device="cuda") * 4
            both[0, :4] = torch.tensor([-1e4, 1e4, -90.0, 90.0])
            gate, up = both[:, :k], both[:, k:]
            bias = torch.randn(n, device="cuda").bfloat16() if i % 2 else None
            product = torch.nn.functional.silu(gate) * up
            want = direct[cfg](product, bias)
            assert torch.equal(plan.gated(gate, up, bias), want), (cfg, graphed, i)
            assert torch.equal(plan(product, bias), want), (cfg, graphed, i)
    plan = fp8_gemm.linear_plan(qd, bs, n, k, m, cfg)
    names = kernels_launched(lambda: plan.gated(gate, up, None))
    assert len(names) == 2 and any("quant_1x128" in n for n in names), names
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan.gated(gate, up, None)
    graph.replay()
    assert torch.equal(captured, direct[cfg](product, None))
