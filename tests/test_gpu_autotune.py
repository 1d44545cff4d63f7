"""Tuning on the GPU: the chosen tactic is never slower than the default (by its own timing) and stays correct."""

import pytest
import torch
from helpers import random_act, random_mx_weight, skip_unless_backend_runs, sqnr_db

import mxgemm
from mxgemm.autotune import Autotuner, TuningCache, environment_metadata
from mxgemm.backends.emulation import emulate_linear

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 64, 1024])
def test_tuning_improves_or_equals_default_and_matches_twin(tmp_path, n, k, m):
    skip_unless_backend_runs("triton")
    q, s = random_mx_weight(n, k, device="cuda")
    weight = mxgemm.prepare_weight(q, s, backend="triton")
    backend = mxgemm.backends.get_backend("triton")
    tuner = Autotuner(TuningCache(tmp_path / "t.json", environment_metadata(mxgemm.describe_device())))
    result = tuner.tune(backend, weight, m, torch.bfloat16)
    assert result.best_us <= result.default_us and result.failed < result.timed
    x = random_act(m, k, device="cuda")
    y = backend.run(x, weight, None, tactic=result.tactic)
    twin = emulate_linear(x, mxgemm.prepare_weight(q, s, backend="emulation"), None)
    assert sqnr_db(y, twin) >= 45
