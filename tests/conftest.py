import os

import pytest
import torch

# Without a GPU, Triton kernels run under its CPU interpreter. It must be set before the kernels are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    """Tests choose backends explicitly; a user's MXGEMM_BACKEND must not leak in."""
    monkeypatch.delenv("MXGEMM_BACKEND", raising=False)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (gpu tests run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
