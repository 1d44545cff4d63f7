"""The hand-written small-M CUDA kernel (hybrid_sm90, M <= 16) on the GPU: every tactic against the exact twin."""

import pytest
import torch
from helpers import (
    assert_within_ulp,
    exact_product,
    hybrid_operands,
    random_act,
    random_mx_weight,
    skip_unless_backend_runs,
)

import mxgemm
from mxgemm.backends.hybrid_sm90 import Path

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _kernel_built():
    skip_unless_backend_runs("hybrid_sm90")
    from mxgemm.kernels.small_m import small_m_status

    status = small_m_status(torch.cuda.get_device_capability())
    if not status:
        pytest.skip(status.reason)


def _exact(x, q, s):
    """Activations as given, the re-encoded weight: the operands the Triton and CUDA small-M paths both multiply."""
    return hybrid_operands(x, q, s, quantized=False)


@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(130, 96), (4160, 4608), (6144, 4096), (4096, 14336)])
def test_every_cuda_tactic_matches_the_twin(m, n, k):
    q, s = random_mx_weight(n, k, seed=n + m, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    w.info["crossover"] = 17  # every M in the exact regime (large weights start the quantized one earlier)
    b = mxgemm.backends.get_backend("hybrid_sm90")
    x = random_act(m, k, seed=k + m, device="cuda")
    product = exact_product(*_exact(x, q, s))
    tactics = [t for t in b.tactics(m, w) if t.path == Path.SMALL_M]
    assert tactics and b.tactics(m, w)[0].path == Path.SMALL_M
    for tactic in tactics:
        y = b.run(x, w, None, tactic=tactic)
        assert y.shape == (m, n) and y.is_contiguous()
        assert_within_ulp(y, product, what=str(tactic))


def test_subnormal_weights_are_not_flushed():
    """Every code with a zero exponent field (E4M3 subnormals), unit scales: the re-encoding keeps them, and the
    kernel's bf16 decode must carry them exactly (a flush would give zeros)."""
    n, k = 256, 1024
    g = torch.Generator(device="cpu").manual_seed(0)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8) & 0x87
    q = codes.view(torch.float8_e4m3fn).cuda()
    s = torch.full((n, k // 32), 127, dtype=torch.uint8, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    x = random_act(4, k, device="cuda")
    b = mxgemm.backends.get_backend("hybrid_sm90")
    assert b.tactics(4, w)[0].path == Path.SMALL_M
    assert_within_ulp(b.run(x, w, None), exact_product(*_exact(x, q, s)), what="subnormal weights")


def test_bias_and_fp16_activations_fall_back_exactly():
    q, s = random_mx_weight(512, 1024, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    bias = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    x = random_act(5, 1024, device="cuda")
    y = mxgemm.linear(x, w, bias)
    assert_within_ulp(y, exact_product(*_exact(x, q, s), bias), what="bias in the epilogue")
    y16 = mxgemm.linear(x.half(), w)  # fp16: the Triton path runs it
    assert y16.dtype == torch.float16
    assert_within_ulp(y16, exact_product(*_exact(x.half(), q, s)), what="fp16 activations")


@pytest.mark.parametrize("m", [1, 9, 16])
def test_graphed_plans_give_the_direct_launches_bits_call_after_call(m):
    """A graphed small-M plan launches its kernel as a CUDA graph, each call's activations, bias and output set into
    its node: the bits of direct launches, call after call on fresh tensors; under capture it launches directly."""
    from mxgemm.backends.hybrid_sm90 import small_m_default
    from mxgemm.kernels.small_m import linear_plan

    q, s = random_mx_weight(4096, 4096, seed=m, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    cfg = small_m_default(*qd.shape)
    graphed = linear_plan(qd, bs, 4096, 4096, m, cfg)
    direct = linear_plan(qd, bs, 4096, 4096, m, cfg, graphed=False)
    for i in range(4):
        x = random_act(m, 4096, seed=i, device="cuda")
        bias = torch.randn(4096, device="cuda").bfloat16() if i % 2 else None
        assert torch.equal(graphed(x, bias), direct(x, bias)), i
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = graphed(x, None)
    graph.replay()
    assert torch.equal(captured, direct(x, None))
