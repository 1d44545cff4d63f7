"""Gated MLPs hand down_proj their product quantized by one kernel (mxgemm.gated): the same outputs as the model's own
steps, taken only where the module's forward is the gated expression with SiLU, and the model's steps wherever the
kernel does not run (fewer rows, hooks, gradients, traced calls)."""

import copy

import pytest
import torch
from helpers import random_act, random_mx_weight
from torch import nn

import mxgemm
from mxgemm import MXFP8Linear, thresholds
from mxgemm.backends import hybrid_sm90
from mxgemm.backends.base import MAX_PLANS
from mxgemm.backends.hybrid_sm90 import HybridSM90Backend
from mxgemm.gated import GATED, fuse_gated_mlps
from mxgemm.kernels import Launch, fp8_gemm
from mxgemm.ops import call_tactic, run_gated, run_planned

transformers = pytest.importorskip("transformers")


def _llama(**kw):
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=500,
        **kw,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _pair(**kw):
    """(the model quantized without fusions, the same with them, the latter's report) on the emulation backend."""
    model = _llama(**kw)
    plain, fused = copy.deepcopy(model), model
    mxgemm.quantize_model(plain, backend="emulation", recipe="hybrid-block128", fuse=False)
    report = mxgemm.quantize_model(fused, backend="emulation", recipe="hybrid-block128")
    return plain, fused, report


@pytest.fixture
def gated_calls(monkeypatch):
    """What each ``on_gated`` call answered: True where the quantized product ran."""
    calls, on_gated = [], MXFP8Linear.on_gated
    monkeypatch.setattr(
        MXFP8Linear, "on_gated", lambda self, g, u: calls.append((y := on_gated(self, g, u)) is not None) or y
    )
    return calls


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_gated_mlps_compute_what_the_models_steps_do(mlp_bias, gated_calls):
    plain, fused, report = _pair(mlp_bias=mlp_bias)
    assert report.fusion[-2:] == tuple(f"model.layers.{i}.mlp{GATED}" for i in range(2))
    assert str(report).endswith(f"2 gated MLPs{GATED}")
    mlp = fused.model.layers[0].mlp
    assert isinstance(mlp, transformers.models.llama.modeling_llama.LlamaMLP) and type(mlp).__name__ == "LlamaMLP"
    assert repr(mlp).startswith("LlamaMLP(\n  product quantized for down_proj in one kernel\n  (gate_proj)")
    assert fused.state_dict().keys() == plain.state_dict().keys()
    crossover = mlp.down_proj.prepared.info["crossover"]
    with torch.no_grad():
        for rows in (1, crossover - 1, crossover, 300):
            ids = torch.randint(0, 500, (1, rows), generator=torch.Generator().manual_seed(rows))
            gated_calls.clear()
            assert torch.equal(fused(ids).logits, plain(ids).logits), rows
            assert gated_calls == [rows >= crossover] * 2, rows  # the exact regime multiplies the bf16 product
    assert fuse_gated_mlps(fused) == []  # taken once
    # its gate/up group and q/k/v: one GEMM up to 4096 rows
    assert mlp.gate_proj.shared[0].max_rows == thresholds.SM90.joined_max_rows
    assert fused.model.layers[0].self_attn.q_proj.shared[0].max_rows == thresholds.SM90.joined_max_rows


def test_only_the_gated_expression_with_silu_is_taken():
    class Swapped(nn.Module):  # up's activation instead of gate's
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)
            self.act_fn = nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.gate_proj(x) * self.act_fn(self.up_proj(x)))

    class Gated(Swapped):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class Gelu(Gated):
        def __init__(self):
            super().__init__()
            self.act_fn = nn.GELU()

    model = nn.ModuleDict({"swapped": Swapped(), "gated": Gated(), "gelu": Gelu(), "plain": Gated()})
    report = mxgemm.quantize_model(model, backend="emulation", recipe="w8a8-mx", skip=("plain.down_proj",))
    exact = nn.ModuleDict({"gated": Gated()})  # an exact recipe never quantizes the product: no kernel claimed
    assert not any(line.endswith(GATED) for line in mxgemm.quantize_model(exact, backend="emulation").fusion)
    assert type(exact["gated"]) is Gated
    assert [line for line in report.fusion if line.endswith(GATED)] == [f"gated{GATED}"]  # plain's down: nn.Linear
    assert type(model["gated"]) is not Gated and isinstance(model["gated"], Gated)
    assert all(type(model[n]) is c for n, c in (("swapped", Swapped), ("gelu", Gelu), ("plain", Gated)))
    # one GEMM up to thresholds.SM90.joined_max_rows rows for the gated MLP's gate/up group only
    assert [model[n].gate_proj.shared[0].max_rows for n in ("gated", "swapped", "gelu", "plain")] == [
        thresholds.SM90.joined_max_rows,
        None,
        None,
        None,
    ]


def test_transformers_activations_other_than_silu_are_not_taken():
    """transformers names many activations ``...Activation``: only its SiLU is SiLU."""
    from transformers import activations

    class Gated(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(64, 96), nn.Linear(64, 96), nn.Linear(96, 64)
            self.act_fn = act

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    acts = {
        "silu": activations.SiLUActivation(),
        "gelu": activations.GELUActivation(),
        "fast": activations.FastGELUActivation(),
    }
    model = nn.ModuleDict({name: Gated(act) for name, act in acts.items()})
    report = mxgemm.quantize_model(model, backend="emulation", recipe="w8a8-mx")
    assert [line for line in report.fusion if line.endswith(GATED)] == [f"silu{GATED}"]


def test_the_models_steps_run_with_hooks_gradients_and_traced(gated_calls):
    plain, fused, _ = _pair()
    ids = torch.randint(0, 500, (1, 300))
    with torch.no_grad():
        ref = plain(ids).logits
    mlp = fused.model.layers[0].mlp
    seen = []
    handle = mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, ref)
    handle.remove()
    assert seen == [(1, 300, 384)] and gated_calls == [True]  # layer 0 ran its own steps, for its hook; layer 1 not
    x = random_act(300, 256).view(1, 300, 256).requires_grad_()
    y = mlp(x)
    y.float().sum().backward()
    assert x.grad is not None and gated_calls == [True, False]


@pytest.mark.parametrize("hooked", [None, "mlp.up_proj", "self_attn.k_proj"])
def test_under_inference_mode_groups_run_as_one_where_their_caller_vouches_unless_hooked(hooked, monkeypatch, tmp_path):
    """Inference tensors keep no version counter, so groups run their members apart under ``inference_mode`` unless
    the module calling them vouches for the input: a gated MLP's forward calls gate and up with nothing between, and
    Llama's attention (taken: a subclass of the same name) hands its input only to q_proj, k_proj and v_proj, so both
    groups run one GEMM there as under no_grad, with the logits of the unfused model. A forward pre-hook on a member
    could change the input in place between the calls: then that group's members run alone, on the input as the hook
    left it. Copies and pickles stay taken."""
    from mxgemm import fusion
    from mxgemm.attention import is_vouched_attention

    plain, fused, _ = _pair()
    attention = fused.model.layers[0].self_attn
    assert is_vouched_attention(attention) and type(attention).__name__ == "LlamaAttention"
    assert not is_vouched_attention(plain.model.layers[0].self_attn)
    joined = []
    monkeypatch.setattr(fusion, "linear", lambda x, w, b: joined.append(x.shape) or mxgemm.weights.linear(x, w, b))

    def doubled(module, args):
        args[0].mul_(2)

    if hooked:
        for model in (plain, fused):
            model.model.layers[0].get_submodule(hooked).register_forward_pre_hook(doubled)
    ids = torch.randint(0, 500, (1, 5))
    with torch.inference_mode():
        assert torch.equal(fused(ids).logits, plain(ids).logits)
    assert len(joined) == (3 if hooked else 4)  # one GEMM for each group run as one: q/k/v and gate/up of 2 layers
    for layer in fused.model.layers:
        assert layer.mlp.gate_proj.shared[0].trusted is None and layer.self_attn.q_proj.shared[0].trusted is None
    if hooked:  # a local function: it does not pickle
        return
    torch.save(fused, tmp_path / "model.pt")
    for twin in (copy.deepcopy(fused), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert type(twin.model.layers[1].self_attn) is type(attention)
        with torch.inference_mode():
            assert torch.equal(twin(ids).logits, fused(ids).logits)


@pytest.mark.parametrize("change", ["gelu", "nn.Linear down_proj", "global hook"])
def test_a_gated_mlp_changed_after_fusion_computes_what_it_now_says(change, gated_calls):
    """A module taken once is checked on every call: an act_fn swapped for GELU runs GELU, a down_proj replaced by an
    nn.Linear runs that layer, and a hook on every module sees down_proj called, all through the model's own steps."""
    plain, fused, _ = _pair()
    ids = torch.randint(0, 500, (1, 300))
    seen, handle = [], None
    for model in (plain, fused):
        mlp = model.model.layers[0].mlp
        if change == "gelu":
            mlp.act_fn = nn.GELU()
        elif change == "nn.Linear down_proj":
            torch.manual_seed(5)
            mlp.down_proj = nn.Linear(384, 256, bias=False).to(torch.bfloat16)
    if change == "global hook":
        down = fused.model.layers[0].mlp.down_proj
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: seen.append(args[0].shape) if m is down else None
        )
    try:
        with torch.no_grad():
            assert torch.equal(fused(ids).logits, plain(ids).logits)
    finally:
        if handle is not None:
            handle.remove()
    assert gated_calls == ([] if change == "global hook" else [True])  # layer 0 its own steps, layer 1 unchanged
    assert seen == ([(1, 300, 384)] if change == "global hook" else [])


def test_traced_gated_mlps_run_one_op_with_the_eager_bits(gated_calls):
    """Traced, a gated MLP leaves one ``mxgemm::linear_gated`` op where the model's steps left SiLU, the product and
    ``down_proj``'s op, from the rows ``on_gated`` takes (the crossover here); it gives the eager call's bits (the
    product as PyTorch computes it eagerly). Fewer rows keep the model's steps. With gradients the traced module
    runs the model's steps."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    plain, fused, _ = _pair()
    crossover = fused.model.layers[0].mlp.down_proj._gated_from
    assert crossover == fused.model.layers[0].mlp.down_proj.prepared.info["crossover"] > 3
    for rows, ops in ((3, 0), (300, 2)):
        graphs = EagerAndRecordGraphs()
        torch._dynamo.reset()
        compiled = torch.compile(fused, backend=graphs, fullgraph=True)
        with torch.no_grad():
            ids = torch.randint(0, 500, (1, rows), generator=torch.Generator().manual_seed(rows))
            assert torch.equal(compiled(ids).logits, plain(ids).logits), rows
        assert [g.code.count("mxgemm.linear_gated") for g in graphs.graphs] == [ops], rows
    assert not gated_calls  # traced: the op, never on_gated
    mlp = torch.compile(fused.model.layers[0].mlp, backend=graphs, fullgraph=True)
    x = random_act(8, 256).view(1, 8, 256).requires_grad_()
    mlp(x).float().sum().backward()
    assert x.grad is not None and "linear_gated" not in graphs.graphs[-1].code


def test_a_gated_mlp_compiled_by_inductor_gives_the_eager_bits():
    """Through inductor (the compiler Hugging Face's CUDA-graph mode uses), a gated MLP's ``mxgemm::linear_gated`` op
    lowers as an opaque call with its fake's shape, at M from the crossover, static and then dynamic: the eager
    call's bits."""
    _, fused, _ = _pair()
    mlp = fused.model.layers[0].mlp
    crossover = mlp.down_proj._gated_from
    torch._dynamo.reset()
    compiled = torch.compile(mlp, fullgraph=True, backend="inductor")
    with torch.no_grad():
        for rows in (crossover, crossover + 5, crossover + 40):
            x = random_act(rows, 256, seed=rows).view(1, rows, 256)
            assert torch.equal(compiled(x), mlp(x)), rows
    torch._dynamo.reset()


def _weight(crossover):
    q, s = random_mx_weight(256, 384)
    weight = HybridSM90Backend().prepare(q, s, "hybrid-block128")
    weight.info.update(crossover=crossover, fp8_sms=132)
    return weight


def test_hybrid_runs_the_gated_product_on_the_route_its_call_takes(monkeypatch):
    """From the crossover: on the FP8 kernel's path its plan's ``.gated`` (the plan of the call's config); on the
    cuBLAS path the planned call's ``.gated`` where planned calls run, else the CUDA gated quantizer's rows through
    ``torch._scaled_mm``. None below the crossover (``gated_from`` says where it starts), for strided inputs and
    without the CUDA quantizer. The route is made once per M."""
    rows, seen, made, fp8_made = object(), [], [], []
    monkeypatch.setattr(fp8_gemm, "quantize_1x128", lambda g, up: rows if (g, up) == (gate, up_) else None)
    monkeypatch.setattr(
        hybrid_sm90,
        "blockwise_linear",
        lambda x, qd, bs, n, bias, quantize: seen.append((x, qd, bs, n, bias, quantize(x))) or x,
    )

    def plan_with_gated(made_here):
        def linear_plan(*args, **launch_kinds):
            made_here.append((*args, launch_kinds))
            gated = Launch(lambda g, u, b: ("gated", g, u, b))
            return Launch(lambda x, bias: pytest.fail("the plan's own call"), gated=gated)

        return linear_plan

    monkeypatch.setattr(fp8_gemm, "linear_plan", plan_with_gated(fp8_made))
    backend, weight = HybridSM90Backend(), _weight(crossover=17)
    assert backend.gated_from(weight) == 17
    gate, up_, bias = random_act(400, 384), random_act(400, 384, seed=2), torch.randn(256).bfloat16()
    assert run_gated(gate[:16], up_[:16], weight, None) is None  # the exact regime below the crossover
    assert run_gated(gate.t().contiguous().t(), up_, weight, None) is None  # not unit stride along K
    g, u = gate[:128], up_[:128]
    for _ in range(2):
        assert run_gated(g, u, weight, bias) == ("gated", g, u, bias)
    config = hybrid_sm90.fp8_default(128, *weight.tensors["qdata"].shape, 132)
    assert [a[3:] for a in fp8_made] == [(384, 128, config, {})]  # the quantizer and the GEMM, one plan
    assert run_gated(gate, up_, weight, bias) is gate
    t = weight.tensors
    assert seen == [(gate, t["qdata"], t["block_scale"], 256, bias, rows)]

    del weight.info["fp8_sms"]  # no CUDA quantizer: never
    assert backend.gated_from(weight) is None and run_gated(gate[:1], up_[:1], weight, None) is None
    weight = _weight(crossover=17)
    weight.info["blockwise_plan"] = True
    monkeypatch.setattr(hybrid_sm90.cublaslt, "linear_plan", plan_with_gated(made))
    for _ in range(2):
        assert run_gated(gate, up_, weight, bias) == ("gated", gate, up_, bias)
    assert len(made) == 1 and len(seen) == 1
    for m in range(129, 129 + MAX_PLANS):  # a workload of many prompt lengths: the plans kept stay bounded
        run_gated(gate[:m], up_[:m], weight, bias)
    assert len(weight.plans) <= MAX_PLANS and len(made) == MAX_PLANS + 1


def test_hybrid_leaves_the_rows_below_the_crossover_to_the_models_steps(monkeypatch):
    """Below the crossover, where the small-M kernel runs on bf16 activations, the model's own steps: nothing is
    routed to the small-M kernel."""
    monkeypatch.setattr(hybrid_sm90, "small_m_plan", lambda *a: pytest.fail("routed to the small-M kernel"))
    backend, weight = HybridSM90Backend(), _weight(crossover=17)
    weight.info["small_m"] = True
    assert backend.gated_from(weight) == 17
    gate, up = random_act(4, 384), random_act(4, 384, seed=2)
    assert run_gated(gate, up, weight, None) is None


def test_a_tuned_tactic_runs_the_gated_product_on_its_own_path(monkeypatch):
    """Where the tuning cache gives a weight's M the FP8 kernel, the gated product runs that kernel's plan of the
    tuned config; no shared rows are taken or read (cuBLASLt on them would be another accumulation order than the
    call's)."""
    from mxgemm import autotune
    from mxgemm.backends.base import Tactic

    backend, weight = HybridSM90Backend(), _weight(crossover=17)
    tuned = Tactic(hybrid_sm90.Path.FP8, hybrid_sm90.fp8_default(64, 256, 384, 132))
    monkeypatch.setattr(autotune, "tactic_for_call", lambda b, w, x: tuned)
    monkeypatch.setattr(fp8_gemm, "quantize_1x128", lambda *a, **k: pytest.fail("quantized apart"))
    made, own = [], []

    def linear_plan(qd, bs, n, k, m, config, graphed=True):
        made.append((m, config, graphed))
        return Launch(lambda x, bias: pytest.fail("the plan's own call"), gated=Launch(lambda g, u, b: g))

    monkeypatch.setattr(fp8_gemm, "linear_plan", linear_plan)
    monkeypatch.setattr(
        HybridSM90Backend, "plan", lambda self, w, m, dtype, tactic=None: lambda x, bias: own.append((m, tactic)) or x
    )
    gate, up = random_act(300, 384), random_act(300, 384, seed=2)
    assert run_gated(gate, up, weight, None) is gate
    assert made == [(300, tuned.config, True)]
    tactic = call_tactic(weight, gate)  # what the callers of the shared-rows routes hand them
    assert tactic == tuned
    assert backend.run_sharing(gate, weight, None, tactic) is None
    assert backend.run_quantized(gate, ("rows", "of another member"), weight, None, tactic) is None
    assert run_planned(gate, weight, None) is gate  # where a member's call reads no shared rows, it runs alone
    assert own == [(300, tuned)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 96), (5, 4160), (130, 416), (300, 14336), (2048, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_gated_quantizer_is_the_quantizer_of_the_product_on_the_gpu(m, k, dtype):
    """Bit for bit the CUDA quantizer of ``silu(gate) * up`` as PyTorch computes it, both kernels' shapes (the wide
    one from 2048 x 14336), on column views of one [M, 2K] output as a joined gate/up GEMM gives them, with values
    whose exponentials overflow and underflow, and products below fp32's normal range, alone in their row (the scale's
    floor) and beside normal ones in their groups."""
    from helpers import skip_unless_backend_runs

    skip_unless_backend_runs("hybrid_sm90")
    both = random_act(m, 2 * k, dtype=dtype, device="cuda") * 4
    both[0, :6] = torch.tensor([-1e4, 1e4, -90.0, 90.0, 0.0, -0.0])
    if dtype == torch.bfloat16 and m > 2:
        both[1] *= 1e-19
        both[2, :k:3] *= 1e-20
        both[2, k::3] *= 1e-20
    gate, up = both[:, :k], both[:, k:]
    q, s = fp8_gemm.quantize_1x128(gate, up=up)
    ref_q, ref_s = fp8_gemm.quantize_1x128(torch.nn.functional.silu(gate) * up)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


@pytest.mark.gpu
def test_gated_mlps_on_the_gpu(gated_calls, monkeypatch):
    """hybrid_sm90 on the H200: a Llama's gated MLPs give the logits of the model's own steps (the same model with
    ``on_gated`` answering None) at every M (the small-M kernel, the FP8 kernel, cuBLASLt planned and through
    ``torch._scaled_mm``), eagerly; the product reaches down_proj quantized by one kernel wherever its call quantizes
    (the FP8 kernel's path and the cuBLAS path)."""
    from helpers import skip_unless_backend_runs

    skip_unless_backend_runs("hybrid_sm90")
    model = (
        transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=1024,
                intermediate_size=3584,
                num_hidden_layers=2,
                num_attention_heads=8,
                num_key_value_heads=2,
                vocab_size=1000,
            )
        )
        .to("cuda", torch.bfloat16)
        .eval()
    )
    report = mxgemm.quantize_model(model, backend="hybrid_sm90")
    assert f"2 gated MLPs{GATED}" in str(report)
    down = model.model.layers[0].mlp.down_proj
    backend = mxgemm.backends.get_backend("hybrid_sm90")
    on_gated, paths = MXFP8Linear.on_gated, set()
    for planned in (True, False):
        for layer in model.modules():
            if isinstance(layer, MXFP8Linear):
                layer.prepared.plans.clear()
                layer.prepared.info["blockwise_plan"] = planned and layer.prepared.info.get("blockwise_plan")
        with torch.no_grad():
            for rows in (1, 16, 64, 300, 1100, 2048, 4100):
                ids = torch.randint(0, 1000, (1, rows), device="cuda")
                gated_calls.clear()
                y = model(ids).logits
                path = backend._default(rows, down.prepared).path
                paths.add(path)
                assert gated_calls == [path.quantized] * 2, rows
                monkeypatch.setattr(MXFP8Linear, "on_gated", lambda self, g, u: None)
                assert torch.equal(y, model(ids).logits), (planned, rows)
                monkeypatch.setattr(MXFP8Linear, "on_gated", on_gated)
    assert paths == {hybrid_sm90.Path.SMALL_M, hybrid_sm90.Path.FP8, hybrid_sm90.Path.CUBLAS}


def test_the_gated_op_computes_silu_of_gate_times_up_where_no_route_runs():
    """Where the backend plans no gated route (the exact recipe here), ``mxgemm::linear_gated`` computes the product
    itself: silu(gate) * up, in that order."""
    from mxgemm.ops import linear_gated_op

    q, s = random_mx_weight(64, 96)
    w = mxgemm.prepare_weight(q, s, backend="emulation", recipe="w8a16")
    gate, up = random_act(5, 96), random_act(5, 96, seed=3)
    y = linear_gated_op(gate, up, w.op_tensors, None, w.backend, w.op_meta)
    assert torch.equal(y, mxgemm.linear(nn.functional.silu(gate) * up, w))
    assert not torch.equal(y, mxgemm.linear(nn.functional.silu(up) * gate, w))


def test_a_gated_model_pickles_and_copies_as_gated(gated_calls, tmp_path):
    plain, fused, _ = _pair()
    torch.save(fused, tmp_path / "model.pt")
    for model in (torch.load(tmp_path / "model.pt", weights_only=False), copy.deepcopy(fused)):
        mlp = model.model.layers[1].mlp
        assert type(mlp) is type(fused.model.layers[1].mlp) and fuse_gated_mlps(model) == []
        ids = torch.randint(0, 500, (1, 300))
        gated_calls.clear()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain(ids).logits)
        assert gated_calls == [True] * 2


def test_an_attention_that_uses_its_input_otherwise_is_not_taken():
    from mxgemm.attention import _input_name, is_vouched_attention

    llama = transformers.models.llama.modeling_llama.LlamaAttention

    class Scaled(llama):
        def forward(self, hidden_states, *args, **kwargs):
            q = self.q_proj(hidden_states)
            hidden_states.mul_(2)
            return q, self.k_proj(hidden_states), self.v_proj(hidden_states)

    class Rebound(llama):
        def forward(self, hidden_states, *args, **kwargs):
            q = self.q_proj(hidden_states)
            hidden_states = hidden_states * 2
            return q, self.k_proj(hidden_states), self.v_proj(hidden_states)

    class Passed(llama):
        def forward(self, hidden_states, *args, **kwargs):
            return self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(torch.relu(hidden_states))

    assert _input_name(llama) == "hidden_states"
    assert [_input_name(c) for c in (Scaled, Rebound, Passed)] == [None, None, None]
    plain = _llama()
    layer = plain.model.layers[0]
    layer.self_attn.__class__ = Scaled
    mxgemm.quantize_model(plain, backend="emulation", recipe="hybrid-block128")
    assert not is_vouched_attention(layer.self_attn) and is_vouched_attention(plain.model.layers[1].self_attn)
