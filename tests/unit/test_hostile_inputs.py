"""Property-based tests over what mxgemm reads from disk: whatever a checkpoint's config, index or safetensors header
holds, and whatever a tuning file holds, the readers answer or refuse with their own one-line error, never another
exception."""

import json
import string

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from mxgemm import tuning
from mxgemm.checkpoints import CheckpointError, TensorSource, read_format

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

keys = st.text(string.ascii_letters + "_.-", max_size=12)
scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=12)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4)
)
# configs shaped like the real ones, with any value in any place
quant_configs = st.fixed_dictionaries(
    {},
    optional={
        "quant_method": st.sampled_from(["compressed-tensors", "modelopt", "mxgemm"]) | json_values,
        "format": st.just("mxfp8-quantized") | json_values,
        "config_groups": json_values
        | st.dictionaries(keys, st.dictionaries(keys, json_values, max_size=3), max_size=2),
        "ignore": json_values,
        "quant_algo": st.just("MXFP8") | json_values,
    },
)


@SETTINGS
@given(config=st.fixed_dictionaries({}, optional={"quantization_config": quant_configs | json_values}) | json_values)
def test_read_format_answers_or_refuses_any_config(tmp_path_factory, config):
    folder = tmp_path_factory.mktemp("ckpt")
    (folder / "config.json").write_text(json.dumps(config))
    try:
        read_format(folder)
    except CheckpointError as exc:
        assert str(exc) and "\n" not in str(exc)


@SETTINGS
@given(data=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_read_format_refuses_any_hf_quant_config(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("ckpt")
    (folder / "hf_quant_config.json").write_bytes(data)
    try:
        read_format(folder)
    except CheckpointError as exc:
        assert str(exc)


@SETTINGS
@given(weight_map=json_values | st.dictionaries(keys, json_values, max_size=4))
def test_an_index_of_any_content_is_read_or_refused(tmp_path_factory, weight_map):
    folder = tmp_path_factory.mktemp("ckpt")
    save_file({"x": torch.zeros(2)}, str(folder / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    try:
        source = TensorSource(folder)
    except CheckpointError as exc:
        assert str(exc)
    else:
        assert set(source.where) == {"x"}


@SETTINGS
@given(header=st.binary(max_size=64), size=st.integers(0, 2**64 - 1))
def test_a_safetensors_file_of_any_header_is_refused_naming_it(tmp_path_factory, header, size):
    folder = tmp_path_factory.mktemp("ckpt")
    (folder / "model.safetensors").write_bytes(size.to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        TensorSource(folder)


@SETTINGS
@given(data=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_a_tuning_file_of_any_content_is_used_or_ignored(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("cache") / "tuning.json"
    path.write_bytes(data)
    cache = tuning.TuningCache(path, {"test": 1})
    assert all(isinstance(k, str) and isinstance(v, dict) and "tactic" in v for k, v in cache.entries.items())
    assert cache.status  # says whether it is used, and why not


@SETTINGS
@given(entries=st.dictionaries(keys, json_values, max_size=5))
def test_a_tuning_file_of_the_right_environment_keeps_only_well_formed_entries(tmp_path_factory, entries):
    path = tmp_path_factory.mktemp("cache") / "tuning.json"
    path.write_text(json.dumps({"metadata": {"test": 1}, "entries": entries}))
    cache = tuning.TuningCache(path, {"test": 1})
    assert set(cache.entries) == {k for k, v in entries.items() if isinstance(v, dict) and "tactic" in v}
