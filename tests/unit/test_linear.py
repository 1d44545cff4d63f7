"""MXFP8Linear: against nn.Linear and its emulated twin, refits, device/dtype moves, bad inputs."""

import os

import pytest
import torch
from helpers import random_act, random_mx_weight, sqnr_db
from torch import nn

import mxgemm
from mxgemm.backends.emulation import emulate_linear

BACKENDS = ["emulation"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def _linear(n, k, bias=True, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,n,k,bias", [(1, 130, 96, True), (3, 130, 96, False), (5, 64, 256, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_against_nn_linear_and_twin(backend, m, n, k, bias, dtype):
    lin = _linear(n, k, bias, dtype=dtype)
    layer = mxgemm.MXFP8Linear.from_linear(lin, backend=backend)
    assert layer.backend == backend and layer.recipe == "w8a16"
    x = random_act(m, k, dtype=dtype)
    with torch.no_grad():
        y, ref = layer(x), lin(x)
    assert y.dtype == dtype and y.shape == (m, n) and torch.isfinite(y).all()
    assert sqnr_db(y, ref) >= 25
    twin = emulate_linear(x, mxgemm.prepare_weight(layer.weight, layer.weight_scale, backend="emulation"), layer.bias)
    assert sqnr_db(y, twin) >= 40


def test_leading_dims_and_empty_batch():
    layer = mxgemm.MXFP8Linear.from_linear(_linear(64, 96), backend="emulation")
    x = random_act(6, 96).reshape(2, 3, 96)
    y = layer(x)
    assert y.shape == (2, 3, 64)
    assert torch.equal(y.reshape(6, 64), layer(x.reshape(6, 96)))
    assert [key[0] for key in layer.prepared.plans.launch] == [6]  # one plan for 6 rows, however they are laid out
    gapped = random_act(10, 96).reshape(2, 5, 96)[:, 1:4]  # rows not evenly strided
    assert not gapped.is_contiguous() and torch.equal(layer(gapped), layer(gapped.contiguous()))
    assert layer(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 64)


@pytest.mark.parametrize("recipe", ["w8a16", "w8a8-mx", "w8a8-block"])
def test_recipes_through_the_layer(recipe):
    lin = _linear(256, 512)
    layer = mxgemm.MXFP8Linear.from_linear(lin, backend="emulation", recipe=recipe)
    assert layer.recipe == recipe and f"recipe={recipe}" in repr(layer)
    x = random_act(4, 512)
    with torch.no_grad():
        assert sqnr_db(layer(x), lin(x)) >= 25


def test_from_quantized_and_scale_modes():
    q, s = random_mx_weight(64, 128)
    layer = mxgemm.MXFP8Linear.from_quantized(q, s, backend="emulation")
    assert layer.bias is None and layer.weight is q
    lin = _linear(64, 128)
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)  # varied block maxima: the two rules differ on some blocks
    rceil = mxgemm.MXFP8Linear.from_linear(lin, backend="emulation", scale_mode="rceil")
    floor = mxgemm.MXFP8Linear.from_linear(lin, backend="emulation", scale_mode="floor")
    assert torch.equal(rceil.weight_scale, mxgemm.quantize(lin.weight.detach(), scale_mode="rceil").scale)
    assert not torch.equal(rceil.weight_scale, floor.weight_scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_refit_equals_fresh(backend):
    q1, s1 = random_mx_weight(130, 96, seed=1)
    q2, s2 = random_mx_weight(130, 96, seed=2)
    s2 = s2.clone()
    s2[4, 1] = 255  # the refit weight has a NaN block; preparation must see it
    bias = torch.randn(130, dtype=torch.bfloat16)
    layer = mxgemm.MXFP8Linear.from_quantized(q1, s1, bias, backend=backend)
    x = random_act(3, 96)
    before = layer(x)
    layer.load_mx_weight(q2, s2)
    fresh = mxgemm.MXFP8Linear.from_quantized(q2, s2, bias, backend=backend)
    after = layer(x)
    assert torch.equal(after.nan_to_num(), fresh(x).nan_to_num())
    assert torch.equal(torch.isnan(after), torch.isnan(fresh(x))) and torch.isnan(after[:, 4]).all()
    assert not torch.equal(before.nan_to_num(), after.nan_to_num())
    with pytest.raises(ValueError, match="new weight must be"):
        layer.load_mx_weight(*random_mx_weight(64, 96))


def test_state_dict_round_trip_re_prepares():
    a = mxgemm.MXFP8Linear.from_linear(_linear(64, 96, seed=1), backend="emulation")
    b = mxgemm.MXFP8Linear.from_linear(_linear(64, 96, seed=2), backend="emulation")
    b.load_state_dict(a.state_dict())
    x = random_act(2, 96)
    assert torch.equal(a(x), b(x))
    assert set(a.state_dict()) == {"weight", "weight_scale", "bias"}


@pytest.mark.parametrize("half", ["weight", "weight_scale"])
def test_half_of_a_weight_and_scale_pair_is_refused(half):
    """A state dict with the weight but not its scale (or the other way round) would leave the layer built from one
    new tensor and one old: refused, even where missing keys are allowed, and the layer keeps its weight."""
    a = mxgemm.MXFP8Linear.from_linear(_linear(64, 96, seed=1), backend="emulation")
    b = mxgemm.MXFP8Linear.from_linear(_linear(64, 96, seed=2), backend="emulation")
    x = random_act(2, 96)
    before = b(x)
    with pytest.raises(RuntimeError, match="weight and weight_scale must be loaded together"):
        b.load_state_dict({half: a.state_dict()[half]}, strict=False)
    assert torch.equal(b(x), before)


def test_module_dtype_casts_keep_the_quantized_weight():
    layer = mxgemm.MXFP8Linear.from_linear(_linear(64, 96, dtype=torch.float32), backend="emulation")
    q = layer.weight.clone()
    layer = layer.to(torch.bfloat16)
    assert layer.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    assert layer.weight_scale.dtype == torch.uint8 and layer.bias.dtype == torch.bfloat16
    layer.half()
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.bias.dtype == torch.float16
    assert layer(random_act(2, 96, dtype=torch.float16)).dtype == torch.float16


def test_bad_inputs():
    layer = mxgemm.MXFP8Linear.from_linear(_linear(64, 96), backend="emulation")
    with pytest.raises(ValueError, match="in_features=96"):
        layer(random_act(2, 64))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        layer(torch.ones(2, 96, dtype=torch.int32))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        mxgemm.linear(torch.randn(2, 96), layer.prepared)  # the functional form takes bf16/fp16 only
    with pytest.raises(ValueError, match="must be 2-D"):
        mxgemm.MXFP8Linear(torch.zeros(2, 2, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 2, 1, dtype=torch.uint8))
    q, s = random_mx_weight(64, 96)
    with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
        mxgemm.MXFP8Linear(q, s, torch.zeros(63), backend="emulation")
    with pytest.raises(ValueError, match=r"bias must have shape \(64,\)"):
        mxgemm.linear(random_act(2, 96), mxgemm.prepare_weight(q, s, backend="emulation"), torch.zeros(3))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxgemm.MXFP8Linear.from_linear(_linear(64, 100))


def test_explicit_backend_that_cannot_run_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(mxgemm.BackendUnavailableError, match="triton"):
        mxgemm.MXFP8Linear.from_linear(_linear(64, 96), backend="triton")


def test_extra_repr():
    layer = mxgemm.MXFP8Linear.from_linear(_linear(64, 96), backend="emulation")
    assert "in_features=96, out_features=64, bias=True, backend=emulation, recipe=w8a16" in repr(layer)


def test_fp32_inputs_run_in_bf16():
    layer = mxgemm.MXFP8Linear.from_linear(_linear(64, 96, dtype=torch.float32), backend="emulation")
    x = torch.randn(3, 96)
    y = layer(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, mxgemm.linear(x.bfloat16(), layer.prepared, layer.bias.bfloat16()).float())


def test_a_bias_replaced_by_a_parameter_is_the_one_used():
    layer = mxgemm.MXFP8Linear.from_linear(_linear(64, 96, bias=False), backend="emulation")
    x = random_act(3, 96)
    layer.bias = nn.Parameter(torch.randn(64, dtype=torch.bfloat16), requires_grad=False)  # now in _parameters
    want = mxgemm.linear(x, layer.prepared, layer.bias)
    with torch.no_grad():
        assert torch.equal(layer(x), want)
        assert torch.equal(torch.compile(layer, backend="aot_eager", fullgraph=True)(x), want)
        assert torch.equal(layer(x.float()), mxgemm.linear(x, layer.prepared, layer.bias).float())


@pytest.mark.parametrize("recipe", ["w8a16", "w8a8-mx", "hybrid-block128"])
def test_gradients_flow_to_the_input_and_bias_through_the_dequantized_weight(recipe):
    """The weight is frozen; ``x`` and ``bias`` get the gradients of ``x @ W^T + bias`` for the dequantized ``W``,
    eager and compiled alike, and an adapter before the layer trains."""
    q, s = random_mx_weight(64, 256)
    w = mxgemm.prepare_weight(q, s, backend="emulation", recipe=recipe)
    deq = mxgemm.dequantize(mxgemm.MXTensor(q, s))
    x = random_act(5, 256).reshape(1, 5, 256).requires_grad_()
    bias = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    grad_y = random_act(5, 64, seed=3).reshape(1, 5, 64)
    y = mxgemm.linear(x, w, bias)
    with torch.no_grad():
        assert torch.equal(y, mxgemm.linear(x, w, bias))  # the forward is the layer's, gradient or not
    y.backward(grad_y)
    g = grad_y.reshape(5, 64)
    assert torch.equal(x.grad.reshape(5, 256), (g.float() @ deq.bfloat16().float()).bfloat16())
    assert torch.equal(bias.grad, g.sum(0))

    adapter = nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    layer = mxgemm.MXFP8Linear.from_quantized(q, s, backend="emulation", recipe=recipe)
    model = nn.Sequential(adapter, layer)
    x2 = random_act(5, 256, seed=5)
    model(x2).float().square().sum().backward()
    eager = adapter.weight.grad.clone()
    adapter.weight.grad = None
    torch.compile(model, backend="aot_eager", fullgraph=True)(x2).float().square().sum().backward()
    assert eager.abs().sum() > 0 and torch.equal(adapter.weight.grad, eager)
