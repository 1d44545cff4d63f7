"""One copy of the weight: what a layer holds, the MX tensors rebuilt from it, state dicts, saves and copies, and the
eager path that skips the op."""

import copy
import io

import pytest
import torch
from helpers import random_act, random_mx_weight

import mxgemm
from mxgemm import block128
from mxgemm.backends import get_backend
from mxgemm.backends.emulation import _effective_weight
from mxgemm.block128 import block128_to_mx, reencode_block128

BLOCK_RECIPES = ("w8a8-block", "hybrid-block128")


def _storages(layer: torch.nn.Module) -> int:
    """Bytes of every distinct storage the layer holds: parameters, buffers and prepared tensors."""
    tensors = [*layer.parameters(), *layer.buffers(), *layer.prepared.tensors.values()]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _mx_value(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return mxgemm.dequantize(mxgemm.MXTensor(q.contiguous(), s))


@pytest.mark.parametrize("recipe", ["w8a16", "w8a8-mx", *BLOCK_RECIPES])
def test_a_layer_holds_one_copy_and_its_state_dict_is_what_it_computes(recipe):
    n, k = 384, 1024
    q, s = random_mx_weight(n, k)
    layer = mxgemm.MXFP8Linear.from_quantized(q.clone(), s.clone(), backend="emulation", recipe=recipe)
    assert _storages(layer) <= 1.07 * n * k
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_scale"}
    assert state["weight"].dtype == torch.float8_e4m3fn and state["weight"].shape == (n, k)
    assert state["weight_scale"].dtype == torch.uint8 and state["weight_scale"].shape == (n, k // 32)
    assert torch.equal(_mx_value(state["weight"], state["weight_scale"]), _effective_weight(layer.prepared))
    if recipe in BLOCK_RECIPES:  # the re-encoded weight replaced the MX one: it differs where its report says
        changed = _mx_value(state["weight"], state["weight_scale"]) != _mx_value(q, s)
        assert int(changed.sum()) == layer.prepared.info["reencode"].changed


@pytest.mark.parametrize("name", ["hybrid_sm90", "cublas_block", "emulation"])
def test_block_backends_prepare_into_one_padded_buffer_and_export_exactly(name):
    """The weight is re-encoded straight into its padded buffer (no second copy) and the MX pair rebuilt from it
    dequantizes to the block weight the GEMM reads, an E8M0 exponent of 0 (2^-127, an fp32 subnormal) included."""
    n, k = 200, 608  # padded to 208 x 1024 for cuBLASLt
    q, s = random_mx_weight(n, k, seed=3)
    s = s.clone()
    s[:128, :4] = 0  # a whole 128x128 block at 2^-127
    s[128:, 4:8] = 140  # and one at 2^13
    backend = get_backend(name)
    recipe = "hybrid-block128" if name != "cublas_block" else "w8a8-block"
    w = backend.prepare(q, s, recipe)
    wq, ws = backend.export_mx(w)
    ref = reencode_block128(q, s)
    assert wq.shape == (n, k) and ws.shape == (n, k // 32)
    assert torch.equal(_mx_value(wq, ws), ref.dequantize())
    assert int(ws[0, 0]) == 0 and int(ws[130, 4]) == 140
    if name != "emulation":
        assert w.tensors["qdata"].shape == (208, 1024)
        assert wq.untyped_storage().data_ptr() == w.tensors["qdata"].untyped_storage().data_ptr()  # a view


def test_chunked_reencoding_equals_the_whole_weight_at_once(monkeypatch):
    q, s = random_mx_weight(300, 512, seed=5)
    s = s.clone()
    s[7, 3] += 9  # shifts its neighbours into E4M3's subnormals: some elements change
    whole = reencode_block128(q, s)
    monkeypatch.setattr(block128, "_CHUNK_ELEMENTS", 128 * 512)  # one 128-row group a chunk
    chunked = reencode_block128(q, s)
    assert whole.report.changed > 0 and chunked.report == whole.report
    assert torch.equal(chunked.qdata.view(torch.uint8), whole.qdata.view(torch.uint8))
    assert torch.equal(chunked.scale, whole.scale)
    assert torch.equal(_mx_value(*block128_to_mx(chunked.qdata, chunked.scale, 300, 512)), whole.dequantize())


def test_state_dict_loads_into_a_fresh_layer_and_bad_entries_name_the_key():
    q, s = random_mx_weight(64, 256)
    a = mxgemm.MXFP8Linear.from_quantized(q, s, torch.randn(64, dtype=torch.bfloat16), backend="emulation")
    q2, s2 = random_mx_weight(64, 256, seed=9)
    b = mxgemm.MXFP8Linear.from_quantized(q2, s2, torch.zeros(64, dtype=torch.bfloat16), backend="emulation")
    b.load_state_dict(a.state_dict())
    x = random_act(3, 256)
    assert torch.equal(b(x), a(x))
    state = a.state_dict()
    for key, bad in (
        ("weight", state["weight"].to(torch.bfloat16)),
        ("weight_scale", state["weight_scale"].float()),
        ("weight", state["weight"][:32]),
    ):
        with pytest.raises(RuntimeError, match=key):
            b.load_state_dict({**state, key: bad})
    with pytest.raises(RuntimeError, match="weight_scale"):
        b.load_state_dict({k: v for k, v in state.items() if k != "weight_scale"})
    assert torch.equal(b(x), a(x))  # a refused load leaves the layer as it was


def test_refits_never_write_the_callers_tensors():
    q, s = random_mx_weight(64, 256)
    q_bytes, s_bytes = q.view(torch.uint8).clone(), s.clone()
    a = mxgemm.MXFP8Linear.from_quantized(q, s, backend="emulation")
    b = mxgemm.MXFP8Linear.from_quantized(q, s, backend="emulation")
    q2, s2 = random_mx_weight(64, 256, seed=4)
    a.load_mx_weight(q2, s2)
    assert torch.equal(q.view(torch.uint8), q_bytes) and torch.equal(s, s_bytes)
    x = random_act(2, 256)
    assert torch.equal(b(x), mxgemm.MXFP8Linear.from_quantized(q, s, backend="emulation")(x))
    assert torch.equal(a(x), mxgemm.MXFP8Linear.from_quantized(q2, s2, backend="emulation")(x))


def test_whole_module_save_load_and_deepcopy_and_dtype_casts():
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    model = model.to(torch.bfloat16)
    mxgemm.quantize_model(model, backend="emulation", skip=())
    x = random_act(5, 256)
    y = model(x)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), y)
    twin = copy.deepcopy(model)
    assert not twin[0].prepared.plans and twin[0].prepared.tensors["qdata"] is not model[0].prepared.tensors["qdata"]
    assert torch.equal(twin(x), y)
    before = model[0].state_dict()["weight"].view(torch.uint8).clone()
    model.to(torch.float8_e5m2)  # casts floating tensors: the bias; never the quantized weight
    model.half()
    assert model[0].bias.dtype == torch.float16
    assert torch.equal(model[0].state_dict()["weight"].view(torch.uint8), before)
    assert model[0].prepared.tensors["qdata"].dtype == torch.float8_e4m3fn


def test_eager_calls_skip_the_op_and_match_it(monkeypatch):
    """Eager: the backend runs through the weight's plan (the op is never called); the op, as compiled graphs run
    it, gives the same values."""
    from mxgemm import weights
    from mxgemm.ops import linear_op

    q, s = random_mx_weight(64, 256)
    w = mxgemm.prepare_weight(q, s, backend="emulation", recipe="hybrid-block128")
    bias = torch.randn(64, dtype=torch.bfloat16)
    x = random_act(7, 256)
    expected = linear_op(x, w.op_tensors, bias, w.backend, w.op_meta)

    def no_op(*args):
        raise AssertionError("the op was called eagerly")

    monkeypatch.setattr(weights, "linear_op", no_op)
    assert torch.equal(mxgemm.linear(x, w, bias), expected)
    assert torch.equal(mxgemm.linear(x.reshape(1, 7, 256), w, bias), expected.reshape(1, 7, 64))
    assert list(w.plans.launch) == [(7, torch.bfloat16, mxgemm.tuning.generation())]
    with pytest.raises(AssertionError, match="eagerly"):  # a gradient asked for: the op (with autograd's rules)
        mxgemm.linear(x.requires_grad_(), w, bias)


@pytest.mark.skipif(not hasattr(torch, "float8_e8m0fnu"), reason="torch without float8_e8m0fnu")
def test_float8_e8m0fnu_scales_are_accepted_wherever_uint8_ones_are():
    """torchao's and PyTorch's E8M0 dtype holds the same bytes as mxgemm's uint8 scales."""
    q, s = random_mx_weight(64, 256)
    e8 = s.view(torch.float8_e8m0fnu)
    assert torch.equal(mxgemm.dequantize(mxgemm.MXTensor(q, e8)), mxgemm.dequantize(mxgemm.MXTensor(q, s)))
    x = random_act(3, 256)
    ref = mxgemm.MXFP8Linear.from_quantized(q, s, backend="emulation")
    layer = mxgemm.MXFP8Linear.from_quantized(q, e8, backend="emulation")
    assert torch.equal(layer(x), ref(x)) and layer.state_dict()["weight_scale"].dtype == torch.uint8
    assert torch.equal(mxgemm.linear(x, mxgemm.prepare_weight(q, e8, backend="emulation")), ref(x))
    other = mxgemm.MXFP8Linear.from_quantized(*random_mx_weight(64, 256, seed=7), backend="emulation")
    other.load_state_dict({"weight": q, "weight_scale": e8})
    assert torch.equal(other(x), ref(x))
