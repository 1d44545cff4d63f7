"""``mxgemm.graphs``: which calls may replay a graph, and copies of a module that holds graphs. The graphs
themselves need a GPU (tests/gpu/test_gpu_grouped.py)."""

import copy
import pickle

import pytest
import torch

from mxgemm import settings
from mxgemm.errors import MXGemmError
from mxgemm.graphs import EagerGraphs, graphable


def test_cpu_tensors_and_traced_calls_are_not_graphed(monkeypatch):
    """Only plain, non-empty CUDA tensors on the default stream, MXGEMM_EAGER_GRAPHS not 0 (on by default), no
    gradients, no capture or tracing under way."""
    x = torch.zeros(2, 4)
    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "1")
    assert not graphable(x)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # past the device test
    capturing, stream = [False], ["default"]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream[0])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: "default")
    assert graphable(x) and graphable(x, max_rows=2) and not graphable(x, max_rows=1)
    assert not graphable(x[:0]) and not graphable(x, x[:, :0])  # no rows, or an empty companion (no experts a token)
    stream[0] = "side"
    assert not graphable(x)
    stream[0] = "default"
    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "0")
    assert not graphable(x)
    monkeypatch.delenv("MXGEMM_EAGER_GRAPHS")
    assert graphable(x)  # on by default
    capturing[0] = True  # the caller's own CUDA graph
    assert not graphable(x)
    capturing[0] = False
    assert not graphable(x.requires_grad_())
    with torch.no_grad():
        assert graphable(x)
    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "0")
    assert not graphable(x.detach())
    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "maybe")
    with pytest.raises(MXGemmError, match="MXGEMM_EAGER_GRAPHS='maybe' is not a switch"):
        settings.eager_graphs_enabled()
    monkeypatch.delenv("MXGEMM_EAGER_GRAPHS")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not graphable(x.detach())


def test_a_signature_runs_directly_until_its_second_call_and_copies_start_empty():
    """On its first call a signature runs the callable itself; copies of the holder (deepcopy, pickle) hold no
    graphs."""
    graphs = EagerGraphs(limit=3)
    calls = []
    x = torch.ones(2)
    assert torch.equal(graphs(lambda t: calls.append(1) or t * 2, x, key="a"), x * 2) and calls == [1]
    assert len(graphs) == 0
    for twin in (copy.deepcopy(graphs), pickle.loads(pickle.dumps(graphs))):
        assert isinstance(twin, EagerGraphs) and len(twin) == 0 and twin.limit == 3 and not twin._seen


def test_calls_from_threads_take_turns():
    """A call from a second thread waits until the first thread's call is done (the static copies are shared)."""
    import threading
    import time

    graphs, order, release = EagerGraphs(), [], threading.Event()

    def slow(t):
        order.append("a starts")
        release.wait(5)
        order.append("a ends")
        return t

    def fast(t):
        order.append("b")
        return t

    first = threading.Thread(target=graphs, args=(slow, torch.ones(1)), kwargs={"key": "a"})
    first.start()
    while not order:
        time.sleep(0.001)
    second = threading.Thread(target=graphs, args=(fast, torch.ones(1)), kwargs={"key": "b"})
    second.start()
    time.sleep(0.05)
    assert order == ["a starts"]
    release.set()
    first.join(5)
    second.join(5)
    assert order == ["a starts", "a ends", "b"]
