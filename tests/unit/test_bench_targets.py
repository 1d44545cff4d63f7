"""bench/targets.py: issue 3's verdicts read off a benchmark JSON's rows."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("targets", Path(__file__).parents[2] / "bench" / "targets.py")
targets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(targets)


def _row(m, n, k, mxgemm, bf16, **more):
    return {"M": m, "N": n, "K": k, "name": "p", "us": {"mxgemm": mxgemm, "bf16": bf16, **more}}


def test_each_regime_counts_its_rows_and_names_its_misses():
    rows = [
        _row(1, 8192, 8192, 10.0, 17.0, dot_scaled=30.0),  # 1.70x: met; 3.0x dot_scaled: met
        _row(16, 8192, 8192, 10.0, 16.9, dot_scaled=29.0),  # 1.69x: missed; 2.9x: missed
        _row(4, 4096, 4096, 10.0, 10.0),  # 16M elements: outside the M <= 16 target; no dot_scaled: not counted
        _row(64, 4096, 4096, 10.0, 14.0, dot_scaled=None),  # 1.4x: met
        _row(4096, 4096, 4096, 10.0, 14.4, triton=16.0),  # 1.44x: missed; triton 0.9x: met
    ]
    got = {v["regime"]: v for v in targets.verdicts(rows)}
    small = got["M <= 16, N*K >= 32Mi"]
    assert (small["met"], small["rows"]) == (1, 2)
    assert small["misses"] == ["p 8192x8192 M=16 1.69"]
    assert (got["M = 64-256"]["met"], got["M = 64-256"]["rows"]) == (1, 1)
    assert (got["M >= 2048"]["met"], got["M >= 2048"]["rows"]) == (0, 1)
    assert got["M >= 2048"]["min"] == got["M >= 2048"]["max"] == pytest.approx(1.44)
    assert (got["exact triton, M >= 2048"]["met"], got["exact triton, M >= 2048"]["rows"]) == (1, 1)
    versus = got["every shape vs dot_scaled"]
    assert (versus["met"], versus["rows"]) == (1, 2)
    assert versus["misses"] == ["p 8192x8192 M=16 2.90"]
