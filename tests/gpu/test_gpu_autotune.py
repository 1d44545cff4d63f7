"""Tuning on the GPU: the chosen tactic is never slower than the default (by its own timing) and stays correct."""

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
)

import mxgemm
from mxgemm.autotune import Autotuner
from mxgemm.tuning import TuningCache, environment_metadata

pytestmark = pytest.mark.gpu


def _check(y, x, q, s, backend, tactic):
    """``y`` within one ulp of what ``backend`` computes with ``tactic`` (the hybrid's path decides whether the
    activations are quantized)."""
    if backend == "triton":
        assert_within_ulp(y, exact_product(x.float(), mxgemm.dequantize(mxgemm.MXTensor(q, s))), what=str(tactic))
        return
    quantized = tactic.path.quantized
    sums = FP8_TENSOR_CORE_SUMS if quantized else FP32_SUMS
    assert_within_ulp(y, exact_product(*hybrid_operands(x, q, s, quantized=quantized)), sums=sums, what=str(tactic))


@pytest.mark.parametrize("backend", ["triton", "hybrid_sm90"])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 64, 1024])
def test_tuning_improves_or_equals_default_and_matches_twin(tmp_path, backend, n, k, m):
    skip_unless_backend_runs(backend)
    q, s = random_mx_weight(n, k, device="cuda")
    weight = mxgemm.prepare_weight(q, s, backend=backend)
    b = mxgemm.backends.get_backend(backend)
    tuner = Autotuner(TuningCache(tmp_path / "t.json", environment_metadata(mxgemm.describe_device())))
    result = tuner.tune(b, weight, m, torch.bfloat16)
    assert result.best_us <= result.default_us and result.failed < result.timed
    x = random_act(m, k, device="cuda")
    _check(b.run(x, weight, None, tactic=result.tactic), x, q, s, backend, result.tactic)


@pytest.mark.parametrize("m", [1, 16, 200])
def test_every_hybrid_tactic_matches_the_twin(m):
    """Not just the chosen one: any tactic a cache may name computes the same recipe."""
    skip_unless_backend_runs("hybrid_sm90")
    n, k = 4160, 4608
    q, s = random_mx_weight(n, k, device="cuda")
    weight = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    b = mxgemm.backends.get_backend("hybrid_sm90")
    x = random_act(m, k, device="cuda")
    for tactic in b.tactics(m, weight):
        _check(b.run(x, weight, None, tactic=tactic), x, q, s, "hybrid_sm90", tactic)


@pytest.mark.parametrize("tokens", [1, 64])
def test_the_blocks_gate_up_tuning_times_the_block_and_keeps_its_recipe(tmp_path, tokens):
    """tune_experts on the triton backend: every gate/up tactic runs the whole block (none fails), the choice is no
    slower than the default by its own timing, and the block's output with it within 1e-2 of the default's, relative
    (the same recipe: the GEMV's fp32 sums, and on the H100 Triton tiles narrower than 128 weight rows in the gated
    form, differ from the default in a last bit, which may move a quantized product by one step)."""
    skip_unless_backend_runs("triton")
    e, hidden, width, topk = 16, 512, 256, 4
    gate_up, down = (
        mxgemm.prepare_grouped_weight(q.view(e, n, k), s.view(e, n, k // 32))
        for n, k in ((2 * width, hidden), (hidden, width))
        for q, s in [random_mx_weight(e * n, k, device="cuda")]
    )
    b = mxgemm.backends.get_backend(gate_up.backend)
    tuner = Autotuner(TuningCache(tmp_path / "t.json", environment_metadata(mxgemm.describe_device())))
    result = tuner.tune_experts(b, gate_up, down, tokens, topk, torch.bfloat16)
    assert result.best_us <= result.default_us and result.failed == 0
    assert str(result.key).startswith("experts|")
    x = random_act(tokens, hidden, device="cuda")
    ids = torch.rand(tokens, e, device="cuda").topk(topk, dim=1).indices
    weights = torch.rand(tokens, topk, device="cuda").softmax(-1).bfloat16()
    tuned = b.run_experts(x, ids, weights, gate_up, down, (result.tactic, None))
    default = b.run_experts(x, ids, weights, gate_up, down)
    assert torch.isfinite(tuned).all() and (tuned - default).float().norm() <= 1e-2 * default.float().norm()
