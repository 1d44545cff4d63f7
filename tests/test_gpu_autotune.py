"""Tuning on the GPU: the chosen tactic is never slower than the default (by its own timing) and stays correct."""

import pytest
import torch
from helpers import hybrid_twin, random_act, random_mx_weight, skip_unless_backend_runs, sqnr_db

import mxgemm
from mxgemm.autotune import Autotuner, TuningCache, environment_metadata
from mxgemm.backends.emulation import emulate_linear

pytestmark = pytest.mark.gpu


def _twin(x, q, s, backend, tactic):
    """The emulated twin of what ``backend`` computes with ``tactic`` (the hybrid's path decides whether the
    activations are quantized)."""
    if backend == "triton":
        return emulate_linear(x, mxgemm.prepare_weight(q, s, backend="emulation"), None)
    return hybrid_twin(x, q, s, quantized=tactic["path"] in ("cublas", "fp8"))


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
    y = b.run(x, weight, None, tactic=result.tactic)
    assert sqnr_db(y, _twin(x, q, s, backend, result.tactic)) >= 40


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
        assert sqnr_db(b.run(x, weight, None, tactic=tactic), _twin(x, q, s, "hybrid_sm90", tactic)) >= 40, tactic
