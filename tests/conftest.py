import importlib
import importlib.util
import os

import pytest
import torch

# Without a GPU, Triton kernels run under its CPU interpreter. It must be set before the kernels are imported: Triton
# decides when a kernel is decorated. So they are all imported now, and a test that unsets the variable (to see what a
# machine without the interpreter sees) cannot leave compiled-mode kernels behind for the tests after it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if importlib.util.find_spec("triton") is not None:
        for _module in ("act_quant", "dequant", "dot_scaled_ref", "grouped.fp8", "mx_quant", "w8a16"):
            importlib.import_module(f"mxgemm.kernels.{_module}")


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch, tmp_path_factory):
    """Tests choose backends explicitly and never see (or write) a user's tuning cache."""
    monkeypatch.delenv("MXGEMM_BACKEND", raising=False)
    monkeypatch.delenv("MXGEMM_AUTOTUNE", raising=False)
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path_factory.mktemp("mxgemm-cache")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (gpu tests run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
