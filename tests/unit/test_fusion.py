"""Layers that read the same input run as one (mxgemm.fusion): the same outputs as each layer alone, one copy of the
weight, the same state dict, and each layer alone wherever running as one would not be right."""

import copy
import dataclasses

import pytest
import torch
from helpers import guards_tag_safe, random_act
from torch import nn

import mxgemm
from mxgemm import fusion, thresholds
from mxgemm.fusion import fuse_shared_inputs
from mxgemm.linear import _TRACED_GROUPS

RECIPES = ("hybrid-block128", "w8a8-mx", "w8a16")


class _Block(nn.Module):
    """A decoder layer's shape of calls: q, k, v on one input, o after; gate and up on another, down after."""

    def __init__(self, hidden=256, kv=128, ffn=384, bias=False):
        super().__init__()
        self.self_attn = nn.ModuleDict(
            {
                "q_proj": nn.Linear(hidden, hidden, bias=bias),
                "k_proj": nn.Linear(hidden, kv, bias=bias),
                "v_proj": nn.Linear(hidden, kv, bias=bias),
                "o_proj": nn.Linear(hidden, hidden, bias=False),
            }
        )
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(hidden, ffn, bias=False),
                "up_proj": nn.Linear(hidden, ffn, bias=False),
                "down_proj": nn.Linear(ffn, hidden, bias=False),
            }
        )

    def forward(self, x):
        a = self.self_attn
        q, k, v = a["q_proj"](x), a["k_proj"](x), a["v_proj"](x)
        h = x + a["o_proj"](q) * torch.cat([k, v], -1).sum(-1, keepdim=True)
        m = self.mlp
        return h + m["down_proj"](torch.nn.functional.silu(m["gate_proj"](h)) * m["up_proj"](h))


def _pair(recipe, bias=False, **kw):
    torch.manual_seed(0)
    alone = _Block(bias=bias, **kw).to(torch.bfloat16)
    fused = copy.deepcopy(alone)
    mxgemm.quantize_model(alone, backend="emulation", recipe=recipe, fuse=False)
    report = mxgemm.quantize_model(fused, backend="emulation", recipe=recipe)
    return alone, fused, report


def _apart_above(model, rows, monkeypatch):
    """Every group of ``model`` runs its members' own GEMMs above ``rows`` rows."""
    table = dataclasses.replace(thresholds.SM90, shared_input_max_rows=rows)
    monkeypatch.setattr(thresholds, "for_device", lambda device: table)
    for layer in model.modules():
        if getattr(layer, "shared", None) is not None:
            layer.shared[0].max_rows = None


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [False, True])
def test_groups_compute_what_each_layer_does_alone(recipe, bias):
    alone, fused, report = _pair(recipe, bias)
    assert report.fusion == ("self_attn: q_proj, k_proj, v_proj", "mlp: gate_proj, up_proj")
    assert "2 groups of layers sharing an input (q/k/v, gate/up) run as one" in str(report)
    assert "shared_input=2" in repr(fused.self_attn["v_proj"]) and "shared_input" not in repr(alone.self_attn["v_proj"])
    with torch.no_grad():
        for m in (1, 16, 64, 300):  # both regimes of hybrid-block128 (crossover 48 here)
            x = torch.randn(2, m, 256, dtype=torch.bfloat16)
            assert torch.equal(fused(x), alone(x)), m
            q = fused.self_attn["q_proj"]
            assert q.shared[0].enabled and not q.shared[0]._pending  # every member took its output


def test_a_member_called_in_another_grad_mode_gets_its_gradients():
    """q called under no_grad makes the group's outputs without a graph; k then called with gradients on the same
    input must not take them: its output carries the gradient of its own call."""
    alone, fused, _ = _pair("w8a16")
    x = random_act(4, 256).requires_grad_()
    ref = x.detach().clone().requires_grad_()
    with torch.no_grad():
        fused.self_attn["q_proj"](x)
    k = fused.self_attn["k_proj"](x)
    assert k.requires_grad
    k.float().sum().backward()
    alone.self_attn["k_proj"](ref).float().sum().backward()
    assert torch.equal(x.grad, ref.grad)


def test_members_of_different_recipes_are_not_fused():
    """One joined weight has one recipe: layers of one input quantized with different recipes run each alone."""
    attn = nn.Module()
    for name, recipe in (("q_proj", "w8a16"), ("k_proj", "w8a8-mx"), ("v_proj", "w8a16")):
        linear = nn.Linear(96, 64, bias=False).to(torch.bfloat16)
        setattr(attn, name, mxgemm.MXFP8Linear.from_linear(linear, backend="emulation", recipe=recipe))
    model = nn.ModuleDict({"self_attn": attn})
    x = random_act(3, 96)
    alone = [getattr(attn, n)(x) for n in ("q_proj", "k_proj", "v_proj")]
    assert fusion.fuse_shared_inputs(model) == [
        "self_attn: q_proj, k_proj, v_proj: not fused (backend, recipe, input size or device differ)"
    ]
    assert all(torch.equal(getattr(attn, n)(x), y) for n, y in zip(("q_proj", "k_proj", "v_proj"), alone, strict=True))


def test_inputs_of_many_rows_run_each_layer_alone(monkeypatch):
    alone, fused, _ = _pair("hybrid-block128")
    _apart_above(fused, 64, monkeypatch)
    names = ("q_proj", "k_proj", "v_proj")
    group = fused.self_attn["q_proj"].shared[0]
    with torch.no_grad():
        for rows, left in ((64, 2), (65, 0)):  # the other members' outputs left for them, or none: each runs alone
            x = torch.randn(1, rows, 256, dtype=torch.bfloat16)
            for i, name in enumerate(names):
                assert torch.equal(fused.self_attn[name](x), alone.self_attn[name](x)), (rows, name)
                assert len(group._pending) == (left - i if i < left else 0)
        x = torch.randn(2, 300, 256, dtype=torch.bfloat16)
        assert torch.equal(fused(x), alone(x))
    assert group.enabled


@pytest.mark.parametrize("recipe", RECIPES)
def test_above_max_rows_the_members_share_one_quantization_of_their_input(monkeypatch, recipe):
    """Each member runs its own GEMM (contiguous outputs) on the input quantized once for the group, where the recipe
    quantizes activations; the input changed in place is quantized again; outputs are each layer's alone."""
    from mxgemm.backends.emulation import EmulationBackend

    alone, fused, _ = _pair(recipe)
    _apart_above(fused, 64, monkeypatch)
    calls = []
    run_sharing = EmulationBackend.run_sharing
    monkeypatch.setattr(
        EmulationBackend, "run_sharing", lambda self, x, w, b, t: calls.append(x.shape) or run_sharing(self, x, w, b, t)
    )
    names = ("q_proj", "k_proj", "v_proj")
    group = fused.self_attn["q_proj"].shared[0]
    quantizes = recipe != "w8a16"
    with torch.no_grad():
        x = torch.randn(2, 100, 256, dtype=torch.bfloat16)
        for i, name in enumerate(names):
            y = fused.self_attn[name](x)
            assert y.is_contiguous() and torch.equal(y, alone.self_attn[name](x)), name
            assert (group._quantized is not None) == (quantizes and i < 2)
        assert calls == [(200, 256)] * (1 if quantizes else 3)  # w8a16: each member's own call asks and runs alone
        fused.self_attn["q_proj"](x)
        x.mul_(2)  # changed in place: quantized anew
        for name in names[1:]:
            assert torch.equal(fused.self_attn[name](x), alone.self_attn[name](x)), name
        assert len(calls) == (3 if quantizes else 6)
    x = torch.randn(100, 256, dtype=torch.bfloat16, requires_grad=True)  # gradients: each member's own call
    fused.self_attn["q_proj"](x).sum().backward()
    assert x.grad is not None and group.enabled


def test_a_group_runs_in_the_regime_of_its_joined_weight(monkeypatch, tmp_path):
    """Where the recipe's crossover falls with the weight's size, a group takes its joined weight's and so does each
    member (alone on its view, it computes what it does in the group); the account says so."""
    from mxgemm.backends import emulation

    monkeypatch.setattr(emulation, "hybrid_crossover", lambda n, k: 1 if n * k >= 700 * 256 else 48)
    alone, fused, report = _pair("hybrid-block128")  # gate/up 384 x 256 each (48), joined 768 x 256 (1)
    assert report.fusion == (
        "self_attn: q_proj, k_proj, v_proj",
        "mlp: gate_proj, up_proj (activations quantized from M = 1, the crossover of their joined weight; alone: 48)",
    )
    assert "2 groups of layers sharing an input" in str(report)
    assert str(report).endswith(
        "\n  1 of those groups: activations quantized from M = 1, the crossover of their joined weight; alone: 48"
    )
    group = fused.mlp["gate_proj"].shared[0]
    assert group.weight.info["crossover"] == 1 and fused.self_attn["q_proj"].shared[0].weight.info["crossover"] == 48
    gate, up = fused.mlp["gate_proj"], fused.mlp["up_proj"]
    assert gate.prepared.info["crossover"] == up.prepared.info["crossover"] == 1
    assert gate.prepared.info["reencode"] == alone.mlp["gate_proj"].prepared.info["reencode"]
    with torch.no_grad():
        x = torch.randn(1, 4, 256, dtype=torch.bfloat16)
        for name in ("gate_proj", "up_proj"):
            own = alone.mlp[name].prepared
            twin = emulation.emulate_linear(x[0], dataclasses.replace(own, info={**own.info, "crossover": 1}), None)
            y = fused.mlp[name](x)[0]
            assert torch.equal(y, twin) and not torch.equal(y, alone.mlp[name](x)[0]), name  # quantized, not exact
        group.disable("test")
        assert torch.equal(gate(x)[0], emulation.emulate_linear(x[0], gate.prepared, None))
    mxgemm.save_checkpoint(alone, tmp_path)  # loaded, the layers join again, in the joined weight's regime
    loaded = _Block().to(torch.bfloat16)
    report = mxgemm.load_checkpoint(loaded, tmp_path, backend="emulation", recipe="hybrid-block128")
    assert str(report).endswith(
        "2 groups of layers sharing an input run as one (1 of them: activations quantized "
        "from M = 1, the crossover of their joined weight; alone: 48)"
    )
    with torch.no_grad():
        assert torch.equal(loaded(x), fused(x))


def test_hybrid_sm90_joins_weights_into_its_crossover_for_their_size():
    """The 8B gate/up layers (14336 x 4096: from M = 16 with the FP8 kernel) joined: 28672 x 4096, from M = 1; with
    the small-M kernel but no FP8 kernel, from M = 17 as each alone is from M = 48. The 70B q/k/v layers (8192 and
    1024 x 8192: from M = 16 and 17) joined: 10240 x 8192, from M = 16."""
    from mxgemm.backends.base import PreparedWeight
    from mxgemm.backends.hybrid_sm90 import HybridSM90Backend

    def weight(n, k, **info):  # joined_info reads sizes and info only
        tensors = {"qdata": torch.zeros(1, 1, dtype=torch.float8_e4m3fn)}
        return PreparedWeight("hybrid_sm90", "hybrid-block128", n, k, tensors, {**info, "reencode": object()})

    backend = HybridSM90Backend()
    for info, alone, joined in (({"small_m": True, "fp8_sms": 132}, 16, 1), ({"small_m": True}, 48, 17)):
        gate = weight(14336, 4096, crossover=alone, **info)
        assert backend.joined_info([gate, gate], 28672) == {**info, "crossover": joined}
        assert backend.joined_info([gate], 14336 + 128)["crossover"] == alone
    info = {"small_m": True, "fp8_sms": 132}
    qkv = [weight(8192, 8192, crossover=16, **info), *[weight(1024, 8192, crossover=17, **info)] * 2]
    assert backend.joined_info(qkv, 10240)["crossover"] == 16


def test_layers_whose_run_time_info_cannot_be_joined_stay_apart():
    """Crossovers given by hand (not the recipe's for the layer's size) must be the same to join."""
    from mxgemm.backends.emulation import EmulationBackend

    torch.manual_seed(0)
    block = _Block().to(torch.bfloat16)
    mxgemm.quantize_model(block, backend="emulation", recipe="hybrid-block128", fuse=False)
    backend = EmulationBackend()
    for name, crossover in (("q_proj", 8), ("k_proj", 8), ("v_proj", 4)):
        layer = block.self_attn[name]
        layer._hold(backend.prepare(layer.weight, layer.weight_scale, "hybrid-block128", crossover=crossover))
    assert fuse_shared_inputs(block) == [
        "self_attn: q_proj, k_proj, v_proj: not fused (they differ in crossover)",
        "mlp: gate_proj, up_proj",
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_one_copy_and_the_same_state_dict(recipe):
    alone, fused, _ = _pair(recipe, bias=True)
    attn = [fused.self_attn[n] for n in ("q_proj", "k_proj", "v_proj")]
    for name in attn[0].prepared.tensors:
        storages = {m.prepared.tensors[name].untyped_storage().data_ptr() for m in attn}
        assert len(storages) == 1
    assert len({m.bias.untyped_storage().data_ptr() for m in attn}) == 1
    group = attn[0].shared[0]
    assert all(m.prepared.nbytes == group.weight.nbytes for m in attn)  # a view holds the group's storage
    assert group.weight.nbytes == sum(alone.self_attn[n].prepared.nbytes for n in ("q_proj", "k_proj", "v_proj"))
    a, f = alone.state_dict(), fused.state_dict()
    assert list(a) == list(f)
    assert all(torch.equal(_bits(a[k]), _bits(f[k])) for k in a)
    fresh = copy.deepcopy(alone)
    fresh.load_state_dict(f)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fresh(x), alone(x))


def test_a_fused_model_saves_every_layer_and_loads_fused(tmp_path):
    alone, fused, _ = _pair("hybrid-block128", bias=True)
    mxgemm.save_checkpoint(fused, tmp_path)
    torch.manual_seed(1)
    fresh = _Block(bias=True).to(torch.bfloat16)
    report = mxgemm.load_checkpoint(fresh, tmp_path, backend="emulation", recipe="hybrid-block128")
    assert report.fusion == ("self_attn: q_proj, k_proj, v_proj", "mlp: gate_proj, up_proj")
    assert str(report).endswith("7 MXFP8 layers loaded, 2 groups of layers sharing an input run as one")
    x = torch.randn(2, 60, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fresh(x), alone(x))


def test_each_layer_alone_where_running_as_one_would_not_be_right():
    alone, fused, _ = _pair("hybrid-block128", bias=True)
    a, f = alone.self_attn, fused.self_attn
    group = f["q_proj"].shared[0]
    x, other = torch.randn(2, 8, 256, dtype=torch.bfloat16), torch.randn(2, 8, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(f["q_proj"](x), a["q_proj"](x))
        assert torch.equal(f["q_proj"](x), a["q_proj"](x))  # twice on one input: the second runs alone
        assert torch.equal(f["k_proj"](other), a["k_proj"](other))  # another input while v has not taken its own
        assert not group.enabled and not group._pending
        assert torch.equal(fused(x), alone(x))
        # a group whose member's bias is replaced runs each layer alone, with the new bias
        alone2, fused2, _ = _pair("hybrid-block128", bias=True)
        for model in (alone2, fused2):
            model.self_attn["k_proj"].bias = torch.ones(128, dtype=torch.bfloat16)
        assert torch.equal(fused2(x), alone2(x))
        assert not fused2.self_attn["q_proj"].shared[0].enabled
        # an input modified in place between two members' calls
        alone3, fused3, _ = _pair("hybrid-block128")
        q3, k3 = fused3.self_attn["q_proj"], fused3.self_attn["k_proj"]
        y = x.clone()
        q3(y)
        y.mul_(2)
        assert torch.equal(k3(y), alone3.self_attn["k_proj"](y))


@pytest.mark.parametrize("max_rows", [None, 4])
def test_under_inference_mode_an_input_changed_in_place_between_members_is_read_anew(max_rows, monkeypatch):
    """Inference tensors keep no version counter, so a group cannot tell its input changed in place: there each member
    runs alone, on the input as it is when called (one GEMM for the group, or one shared quantization above
    ``max_rows``, would give k and v the outputs of q's input)."""
    alone, fused, _ = _pair("w8a8-mx")
    if max_rows:
        _apart_above(fused, max_rows, monkeypatch)
    names = ("q_proj", "k_proj", "v_proj")
    group = fused.self_attn["q_proj"].shared[0]
    with torch.inference_mode():
        x = torch.randn(2, 8, 256, dtype=torch.bfloat16)
        for name in names:
            assert torch.equal(fused.self_attn[name](x), alone.self_attn[name](x)), name
            x.mul_(2)
        assert group.enabled and not group._pending and group._quantized is None
        assert torch.equal(fused(x), alone(x))


def test_reloading_a_member_and_fp32_inputs_and_gradients():
    alone, fused, _ = _pair("w8a8-mx")
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fused(x.float()), alone(x.float()))  # fp32 inputs: each layer alone, cast per layer
    xa, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    alone(xa).float().square().sum().backward()
    fused(xf).float().square().sum().backward()
    # one matmul against three, each rounded to bf16: another summation order
    assert (xf.grad - xa.grad).abs().max() <= 0.02 * xa.grad.abs().max()
    k = fused.self_attn["k_proj"]
    group = k.shared[0]
    k.load_state_dict(alone.self_attn["k_proj"].state_dict())  # re-prepares k: the group runs its layers alone
    assert k.shared is None and not group.enabled
    with torch.no_grad():
        assert torch.equal(fused(x), alone(x))
    account = mxgemm.fuse(fused)  # the groups made again, q/k/v with k's new weight
    assert "self_attn: q_proj, k_proj, v_proj" in account and k.shared is not None and k.shared[0].enabled
    with torch.no_grad():
        assert torch.equal(fused(x), alone(x))


def test_traced_calls_run_each_group_as_one_op():
    from torch._dynamo.testing import EagerAndRecordGraphs

    alone, fused, _ = _pair("hybrid-block128")
    graphs = EagerAndRecordGraphs()
    compiled = torch.compile(fused, backend=graphs, fullgraph=True)
    with torch.no_grad():
        for m in (4, 64):  # both regimes
            x = torch.randn(m, 256, dtype=torch.bfloat16)
            assert torch.equal(compiled(x), fused(x))
            if m < fused.self_attn["q_proj"].shared[0].weight.info["crossover"]:
                assert torch.equal(compiled(x), alone(x))
    assert graphs.graphs[0].code.count("mxgemm.linear") == 4  # q/k/v, o, gate/up, down
    group = fused.self_attn["q_proj"].shared[0]
    assert group.enabled and group._x is None and not group._pending
    assert not _TRACED_GROUPS  # every member took its view


def test_traced_calls_take_each_groups_threshold():
    """Traced calls run a group's members apart above the group's threshold, as eager calls do: q/k/v's set to 64
    rows here, gate/up's ``shared_input_max_rows``."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    _, fused, _ = _pair("hybrid-block128")
    assert fused.self_attn["q_proj"]._traced_group["max_rows"] == thresholds.SM90.joined_max_rows  # set by fuse
    fused.self_attn["q_proj"].shared[0].max_rows = 64
    assert fused.self_attn["v_proj"]._traced_group["max_rows"] == 64
    assert fused.mlp["up_proj"]._traced_group["max_rows"] == thresholds.SM90.shared_input_max_rows
    graphs = EagerAndRecordGraphs()
    compiled = torch.compile(fused, backend=graphs, fullgraph=True)
    with torch.no_grad():
        x = torch.randn(100, 256, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), fused(x))
    assert graphs.graphs[0].code.count("mxgemm.linear") == 6  # q, k, v, o, gate/up, down


def test_compiled_layers_guard_only_plain_values_of_their_own():
    """Every MXFP8Linear of a compiled block (groups and lone layers) reads only plain values in its own __dict__:
    with Dynamo's recursive dict tags (on by default in torch 2.11) its guards are skipped while the __dict__ is
    unchanged, as an nn.Linear's are; a read through an object of ours makes each guard run on every call."""
    torch._dynamo.reset()
    _, fused, _ = _pair("hybrid-block128")
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True), torch.no_grad():
        compiled(torch.randn(4, 256, dtype=torch.bfloat16))
        safe = guards_tag_safe(_Block.forward.__code__)
    # the layers themselves, not their values
    layers = {source.rsplit("'", 2)[1]: tag_safe for source, tag_safe in safe.items() if source.endswith("_proj']")}
    assert layers == dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), True)
    torch._dynamo.reset()


def test_a_traced_cross_attention_runs_each_layer_alone():
    alone, fused, _ = _pair("hybrid-block128")
    a, f = alone.self_attn, fused.self_attn
    compiled = torch.compile(
        lambda x, enc: (f["q_proj"](x), f["k_proj"](enc), f["v_proj"](enc)), backend="aot_eager", fullgraph=True
    )
    x, enc = torch.randn(3, 256, dtype=torch.bfloat16), torch.randn(5, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        for y, ref in zip(compiled(x, enc), (a["q_proj"](x), a["k_proj"](enc), a["v_proj"](enc)), strict=True):
            assert torch.equal(y, ref)
    assert not f["q_proj"].shared[0].enabled and not _TRACED_GROUPS


def test_unfit_groups_stay_as_they_are_and_the_report_says_why():
    # 192 output rows are not whole 128-row blocks of the block recipe's scales
    _, fused, report = _pair("hybrid-block128", kv=192)
    assert report.fusion[0] == (
        "self_attn: q_proj, k_proj, v_proj: not fused (out_features=192 is not a whole "
        "number of block_scale's 128-row groups)"
    )
    assert fused.self_attn["k_proj"].shared is None and fused.mlp["up_proj"].shared is not None
    assert "1 groups not fused: out_features=192" in str(report)
    torch.manual_seed(0)
    mixed = _Block().to(torch.bfloat16)
    mxgemm.quantize_model(mixed, backend="emulation", recipe="w8a16", skip=("k_proj",))
    assert "self_attn: q_proj, k_proj, v_proj" not in " ".join(fuse_shared_inputs(mixed))  # k is an nn.Linear
    assert fuse_shared_inputs(mixed) == ["mlp: gate_proj, up_proj: not fused (already in a group)"]


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,kv,ffn", [(1024, 256, 2048), (896, 128, 4864)])  # 896: views at 64-byte offsets
def test_hybrid_sm90_groups_on_the_gpu(hidden, kv, ffn):
    """On the H200: below the crossover (the exact regime) and above the group's threshold (``joined_max_rows`` for
    q/k/v, ``shared_input_max_rows`` for this gate/up group, not a gated MLP's) the same bits as each layer alone;
    between them the quantized GEMM's own rounding at most, eager and replayed from a CUDA graph."""
    from helpers import skip_unless_backend_runs

    skip_unless_backend_runs("hybrid_sm90")
    torch.manual_seed(0)
    alone = _Block(hidden=hidden, kv=kv, ffn=ffn, bias=True).to("cuda", torch.bfloat16)
    fused = copy.deepcopy(alone)
    mxgemm.quantize_model(alone, backend="hybrid_sm90", fuse=False)
    assert len(mxgemm.quantize_model(fused, backend="hybrid_sm90").fusion) == 2
    crossover = fused.self_attn["q_proj"].shared[0].weight.info["crossover"]
    with torch.no_grad():
        for m in (1, 8, 16, 24, 64, 300, 2048, 4097):
            x = torch.randn(1, m, hidden, device="cuda", dtype=torch.bfloat16)
            for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
                ys = [getattr(fused, part)[n](x) for n in names]  # in turn on one input: one GEMM for the group
                limit = getattr(fused, part)[names[0]].shared[0].max_rows or thresholds.SM90.shared_input_max_rows
                for y, n in zip(ys, names, strict=True):
                    ref = getattr(alone, part)[n](x)
                    # below the crossover, and above the threshold (each member's own GEMM on one quantization of x)
                    if m < crossover or m > limit:
                        assert torch.equal(y, ref), (m, n)
                    else:
                        assert (y.float() - ref.float()).abs().max() <= 2**-7 * ref.float().abs().max(), (m, n)
        x = torch.randn(4, hidden, device="cuda", dtype=torch.bfloat16)
        graph, out = torch.cuda.CUDAGraph(), None
        fused(x)  # plans made outside capture
        with torch.cuda.graph(graph):
            out = fused(x)
        graph.replay()
        assert torch.equal(out, alone(x))  # M = 4: the exact regime


@pytest.mark.gpu
@pytest.mark.parametrize(
    "part,sizes,hidden,account",
    [
        (
            "mlp",
            {"gate_proj": 14336, "up_proj": 14336},
            4096,
            "from M = 1, the crossover of their joined weight; alone: 16",
        ),
        (
            "self_attn",
            {"q_proj": 8192, "k_proj": 1024, "v_proj": 1024},
            8192,
            "from M = 16, the crossover of their joined weight; alone: 16 or 17",
        ),
    ],
)
def test_groups_run_in_their_joined_weights_regime_on_the_gpu(part, sizes, hidden, account):
    """On the H200: Llama-3-8B's gate and up layers (14336 x 4096 each, quantized from M = 16 alone) joined run the
    FP8 kernel from M = 1, as their 28672 x 4096 weight would alone; Llama-3-70B's q, k and v (from M = 16, 17, 17)
    from M = 16. Each output within the quantized GEMM's rounding of its exact emulated twin at the group's crossover
    in the group and alone on its view."""
    from helpers import skip_unless_backend_runs

    from mxgemm.backends.emulation import emulate_linear

    skip_unless_backend_runs("hybrid_sm90")
    torch.manual_seed(0)
    layers = nn.ModuleDict({n: nn.Linear(hidden, size, bias=False) for n, size in sizes.items()})
    model = nn.ModuleDict({part: layers}).to("cuda", torch.bfloat16)
    report = mxgemm.quantize_model(model, backend="hybrid_sm90")
    layers = model[part]
    if "fp8_sms" not in layers[next(iter(sizes))].prepared.info:
        pytest.skip("the FP8 kernel is not built here")
    assert report.fusion == (f"{part}: {', '.join(sizes)} (activations quantized {account})",)
    with torch.no_grad():
        xs = [torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16) for m in (1, 4, 15, 16)]
        for alone in (False, True):  # in the group; then each alone on its view
            if alone:
                layers[next(iter(sizes))].shared[0].disable("test")
            for x in xs:
                ys = [layers[n](x) for n in sizes]
                for y, n in zip(ys, sizes, strict=True):
                    twin = emulate_linear(x, layers[n].prepared, None).float()
                    assert (y.float() - twin).abs().max() <= 2**-7 * twin.abs().max(), (alone, x.shape[0], n)
