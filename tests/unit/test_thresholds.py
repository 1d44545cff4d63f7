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
    assert "H200" in sm90.measured_on and "H100" in sm90.measured_on
    with pytest.raises(dataclasses.FrozenInstanceError):
        sm90.dequant_min_m = 1
