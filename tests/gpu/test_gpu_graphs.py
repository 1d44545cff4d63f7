"""MXFP8Linear models under torch.compile and CUDA graphs on the GPU: same results as eager."""

import pytest
import torch
from helpers import random_act, skip_unless_backend_runs
from torch import nn

import mxgemm
from mxgemm import autotune

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _gpu():
    skip_unless_backend_runs("triton")


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(1024, 4096)
        self.down = nn.Linear(4096, 1024)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def _model(backend=None):
    torch.manual_seed(0)
    model = _MLP().to("cuda", torch.bfloat16)
    mxgemm.quantize_model(model, backend=backend)
    return model


@pytest.mark.parametrize("backend", [None, "triton"])
def test_cuda_graph_replay_matches_eager(backend, monkeypatch):
    model = _model(backend)
    tuned = []
    monkeypatch.setattr(autotune.Autotuner, "tune", lambda *a, **k: tuned.append(a))
    monkeypatch.setenv("MXGEMM_AUTOTUNE", "1")  # even when asked to, nothing tunes during capture
    for m in (1, 5, 64, 300):
        static_x = random_act(m, 1024, device="cuda")
        with torch.no_grad():
            eager = model(static_x)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                model(static_x)  # warm-up outside capture: kernels compiled, counters allocated
            torch.cuda.current_stream().wait_stream(stream)
            tuned.clear()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = model(static_x)
            assert tuned == []
            for seed in (1, 2):
                x = random_act(m, 1024, seed=seed, device="cuda")
                static_x.copy_(x)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(static_y, model(x)), (backend, m, seed)
        assert torch.equal(eager, model(random_act(m, 1024, device="cuda")))


@pytest.mark.parametrize("backend", [None, "triton"])
def test_compile_fullgraph_matches_eager_on_gpu(backend):
    model = _model(backend)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for m in (1, 16, 257):
            x = random_act(m, 1024, seed=m, device="cuda")
            assert torch.equal(compiled(x), model(x))
