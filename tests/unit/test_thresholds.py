"""``mxgemm.thresholds``: one table of measured switch points per architecture, SM90's for the rest."""

import dataclasses

import pytest
import torch

from mxgemm import thresholds


def test_every_device_finds_a_table_and_sm90_holds_the_measured_values():
    sm90 = thresholds.SM90
    assert thresholds.for_sm(90) is sm90
    assert thresholds.for_sm(None) is sm90 and thresholds.for_sm(100) is sm90  # only SM90 was measured
    assert thresholds.for_device(torch.device("cpu")) is sm90  # the interpreter's runs
    assert (sm90.dequant_min_m, sm90.shared_input_max_rows, sm90.joined_max_rows) == (256, 1024, 4096)
    assert (sm90.grouped_wgmma_from, sm90.grouped_wgmma_deep_k, sm90.grouped_persistent_max_k) == (8, 4096, 2048)
    assert sm90.grouped_gemv_experts_per_row == 8
    assert "H200" in sm90.measured_on and "H100" in sm90.measured_on
    with pytest.raises(dataclasses.FrozenInstanceError):
        sm90.dequant_min_m = 1


def test_hybrids_crossover_follows_the_table():
    """``recipes.hybrid_crossover`` reads its switch points from the table: SM90's give the measured crossovers of
    Llama-3's weights (8B o: 16.8M elements, 8B gate_up: 117M, 70B o: 67M, 8B down: K = 14336), another table others."""
    from mxgemm.recipes import hybrid_crossover

    sm90 = thresholds.SM90
    elements = (sm90.crossover_large_elements, sm90.crossover_mid_elements)
    assert elements == (96 << 20, 32 << 20) and sm90.crossover_mid_m == 16
    assert (sm90.crossover_deep_k, sm90.crossover_deep_m, sm90.crossover_m) == (12288, 96, 48)
    with_fp8 = [hybrid_crossover(n, k, fp8=True) for n, k in [(4096, 4096), (28672, 4096), (8192, 8192)]]
    assert with_fp8 == [17, 1, 16]
    without = [hybrid_crossover(n, k, small_m=False) for n, k in [(4096, 14336), (4096, 4096), (28672, 4096)]]
    assert without == [96, 48, 1] and hybrid_crossover(28672, 4096) == 17  # never inside the small-M kernel's rows
    other = dataclasses.replace(sm90, crossover_m=64, crossover_mid_m=8)
    assert hybrid_crossover(4096, 4096, small_m=False, table=other) == 64
    assert hybrid_crossover(8192, 8192, fp8=True, table=other) == 8
