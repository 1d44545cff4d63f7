"""Custom ops: opcheck, fake shapes and strides on the meta device, torch.compile(fullgraph=True) == eager."""

import os

import pytest
import torch
from helpers import random_act, random_mx_weight
from torch import nn

import mxgemm
from mxgemm.ops import linear_op, quantize_1x128_op, quantize_mx_op

RECIPES = ["w8a16", "w8a8-mx", "w8a8-block", "hybrid-block128"]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_opcheck_linear(recipe, with_bias):
    q, s = random_mx_weight(130, 96)
    w = mxgemm.prepare_weight(q, s, backend="emulation", recipe=recipe)
    bias = torch.randn(130, dtype=torch.bfloat16) if with_bias else None
    args = (random_act(3, 96), w.op_tensors, bias, w.backend, w.op_meta)
    torch.library.opcheck(linear_op, args)


def test_opcheck_quantizers():
    torch.library.opcheck(quantize_mx_op, (random_act(4, 64), "floor", torch.float8_e4m3fn))
    torch.library.opcheck(quantize_mx_op, (random_act(4, 64, dtype=torch.float16), "rceil", torch.float8_e5m2))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton quantizer runs under the interpreter")
def test_opcheck_quantize_1x128():
    torch.library.opcheck(quantize_1x128_op, (random_act(5, 416),))


def test_fake_shapes_and_strides_on_meta():
    q, s = random_mx_weight(130, 96)
    w = mxgemm.prepare_weight(q, s, backend="emulation")
    x = torch.empty(7, 96, device="meta", dtype=torch.float16)
    y = linear_op(x, [t.to("meta") for t in w.op_tensors], None, w.backend, w.op_meta)
    assert y.device.type == "meta" and y.shape == (7, 130) and y.dtype == torch.float16 and y.stride() == (130, 1)
    qd, sc = quantize_mx_op(torch.empty(2, 3, 64, device="meta"), "floor", torch.float8_e4m3fn)
    assert (
        qd.shape == (2, 3, 64) and qd.dtype == torch.float8_e4m3fn and sc.shape == (2, 3, 2) and sc.dtype == torch.uint8
    )
    q8, s8 = quantize_1x128_op(torch.empty(5, 416, device="meta", dtype=torch.bfloat16))
    assert q8.shape == (8, 512) and s8.shape == (8, 4) and s8.stride() == (1, 8) and s8.dtype == torch.float32


def test_fake_matches_real_for_every_recipe():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, s = random_mx_weight(130, 96)
    x = random_act(5, 96)
    for recipe in RECIPES:
        w = mxgemm.prepare_weight(q, s, backend="emulation", recipe=recipe)
        real = linear_op(x, w.op_tensors, None, w.backend, w.op_meta)
        with FakeTensorMode() as mode:
            fake = linear_op(
                mode.from_tensor(x), [mode.from_tensor(t) for t in w.op_tensors], None, w.backend, w.op_meta
            )
        assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(96, 256)
        self.down = nn.Linear(256, 64, bias=False)
        self.lm_head = nn.Linear(64, 10)

    def forward(self, x):
        return self.lm_head(torch.relu(self.down(torch.nn.functional.gelu(self.up(x)))))


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(compile_backend):
    torch.manual_seed(0)
    model = _Block().to(torch.bfloat16)
    mxgemm.quantize_model(model, backend="emulation")
    x = random_act(4, 96).reshape(2, 2, 96)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True, backend=compile_backend)
    for m in (4, 7):  # a second shape: recompiles or runs dynamic, never breaks the graph
        xm = random_act(m, 96, seed=m).reshape(1, m, 96)
        assert torch.equal(compiled(xm), model(xm))
    assert torch.equal(compiled(x), eager)


def test_compile_sees_one_op_per_layer():
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _Block().to(torch.bfloat16)
    mxgemm.quantize_model(model, backend="emulation", skip=())
    counter = CompileCounterWithBackend("aot_eager")
    torch.compile(model, fullgraph=True, backend=counter)(random_act(3, 96))
    assert counter.frame_count == 1
    graph = counter.graphs[0]
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "mxgemm" in str(n.target)]
    assert len(calls) == 3


def test_the_op_runs_the_live_weights_plan_and_forgets_dropped_weights():
    """Called with a prepared weight's own op tensors (as compiled graphs call it), the op runs that weight's launch
    plan, made once; other tensors with the same meta are rebuilt into a weight of their own; a dropped weight is
    not kept alive for it."""
    import copy
    import gc
    import weakref

    q, s = random_mx_weight(64, 256)
    w = mxgemm.prepare_weight(q, s, backend="emulation", recipe="hybrid-block128")
    x = random_act(3, 256)
    y = linear_op(x, w.op_tensors, None, w.backend, w.op_meta)
    assert list(w.plans.launch) == [(3, torch.bfloat16, mxgemm.tuning.generation())]
    plan = w.plans.launch[(3, torch.bfloat16, mxgemm.tuning.generation())]
    assert torch.equal(linear_op(x, w.op_tensors, None, w.backend, w.op_meta), y) and len(w.plans) == 1
    assert w.plans.launch[(3, torch.bfloat16, mxgemm.tuning.generation())] is plan
    copies = [t.clone() for t in w.op_tensors]
    assert torch.equal(linear_op(x, copies, None, w.backend, w.op_meta), y)
    y4 = linear_op(random_act(4, 256), copies, None, w.backend, w.op_meta)
    assert len(w.plans) == 1 and torch.equal(y4, mxgemm.linear(random_act(4, 256), w))
    twin = copy.deepcopy(w)  # a copy (a deep-copied or unpickled model) is found by its own tensors
    assert not twin.plans and torch.equal(linear_op(x, twin.op_tensors, None, w.backend, w.op_meta), y)
    assert list(twin.plans.launch) == [(3, torch.bfloat16, mxgemm.tuning.generation())]
    ref = weakref.ref(w)
    gc.disable()  # freed by reference counting, the moment the last holder lets go: no cycle through its plans
    try:
        del w, plan
        assert ref() is None
    finally:
        gc.enable()
