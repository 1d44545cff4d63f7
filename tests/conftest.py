import os

import pytest
import torch

# Without a GPU, Triton kernels run under its CPU interpreter. It must be set before the kernels are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
