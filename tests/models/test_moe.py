"""The routed experts of a mixture of experts on CPU: ``moe_experts`` equal to each token's experts run one by one
through their dense calls, ``MXFP8Experts`` in place of transformers' 3-D experts in tiny random Qwen3-MoE, Qwen2-MoE
and Mixtral models (routers kept), compile fullgraph, and what is refused by name."""

import copy
import re

import pytest
import torch
from helpers import guards_tag_safe, random_act, sqnr_db, tiny_qwen3_moe
from torch import nn

import mxgemm
from mxgemm.moe import MXFP8Experts, experts_unfit_reason

transformers = pytest.importorskip("transformers")

E, H, I = 4, 64, 96  # noqa: E741 (the expert width, as the papers name it)


def _experts(seed=0):
    torch.manual_seed(seed)
    gate_up = torch.randn(E, 2 * I, H) * 0.05
    down = torch.randn(E, H, I) * 0.05
    pair = [mxgemm.quantize(w) for w in (gate_up, down)]
    return [mxgemm.prepare_grouped_weight(t.qdata, t.scale, backend="emulation") for t in pair], pair


def _routing(tokens, k, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "one expert":
        ids = torch.full((tokens, k), 2, dtype=torch.int64)
        ids[:, 1:] = torch.randint(0, E, (tokens, k - 1), generator=g)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).softmax(-1)
    return ids, weights


@pytest.mark.parametrize("tokens, kind", [(1, "random"), (7, "random"), (9, "one expert")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_experts_is_each_tokens_experts_run_one_by_one(tokens, kind, dtype):
    (gate_up, down), (gq, dq) = _experts()
    x = random_act(tokens, H, dtype=dtype)
    ids, weights = _routing(tokens, 2, kind)
    y = mxgemm.moe_experts(x, ids, weights, gate_up, down)
    assert y.shape == (tokens, H) and y.dtype == dtype and torch.isfinite(y).all()
    dense = {
        (name, e): mxgemm.prepare_weight(t.qdata[e], t.scale[e], backend="emulation")
        for name, t in (("gate_up", gq), ("down", dq))
        for e in range(E)
    }
    for t in range(tokens):
        outs = []
        for j in range(2):
            e = int(ids[t, j])
            gate, up = mxgemm.linear(x[t : t + 1], dense["gate_up", e]).chunk(2, -1)
            outs.append(mxgemm.linear(nn.functional.silu(gate) * up, dense["down", e])[0])
        expected = (torch.stack(outs) * weights[t].to(dtype).unsqueeze(-1)).sum(0)
        assert torch.equal(y[t], expected), t


@pytest.mark.parametrize(
    "case, error, message",
    [
        ("ids of other tokens", ValueError, r"topk_ids and topk_weights must both be \[T, k\] for x of 3 tokens"),
        ("float ids", TypeError, "topk_ids must hold integer expert ids, got torch.float32"),
        ("x of other H", ValueError, rf"x must be \[T, {H}\], got shape \(3, 32\)"),
        ("x of a batch", ValueError, rf"x must be \[T, {H}\], got shape \(1, 3, {H}\)"),
        ("not one layer's", ValueError, "are not one layer's experts"),
        ("two backends", ValueError, "gate_up runs on emulation and down on triton; prepare both on one backend"),
        ("a module of two backends", ValueError, "gate_up runs on emulation and down on triton"),
        ("dense weights", TypeError, "gate_up must be a PreparedGroupedWeight .* got PreparedWeight; a dense weight"),
    ],
)
def test_bad_input_is_a_one_line_error(case, error, message):
    (gate_up, down), (_, dq) = _experts()
    x = random_act(3, H)
    ids, weights = _routing(3, 2, "random")
    with pytest.raises(error, match=message):
        if case == "ids of other tokens":
            mxgemm.moe_experts(x, ids[:2], weights[:2], gate_up, down)
        elif case == "float ids":
            mxgemm.moe_experts(x, ids.float(), weights, gate_up, down)
        elif case == "x of other H":
            mxgemm.moe_experts(x[:, :32], ids, weights, gate_up, down)
        elif case == "x of a batch":  # [B, S, H]: the shape said, not the routing's
            mxgemm.moe_experts(x[None], ids, weights, gate_up, down)
        elif case == "not one layer's":
            mxgemm.moe_experts(x, ids, weights, gate_up, gate_up)
        elif case == "dense weights":
            dense = mxgemm.prepare_weight(dq.qdata[0], dq.scale[0], backend="emulation")
            mxgemm.moe_experts(x, ids, weights, dense, dense)
        else:
            other = mxgemm.prepare_grouped_weight(dq.qdata, dq.scale, backend="triton")
            if case == "two backends":
                mxgemm.moe_experts(x, ids, weights, gate_up, other)
            else:
                MXFP8Experts(gate_up, other)


@pytest.mark.parametrize("tokens, k", [(0, 2), (3, 0)])
def test_no_token_copies_answer_zeros(tokens, k):
    """No tokens (an empty batch) or no experts a token (k = 0): [T, H] zeros, no launch, as a call and as the
    module; the same through compile."""
    (gate_up, down), _ = _experts()
    x = random_act(3, H)[:tokens]
    ids, weights = _routing(3, 2, "random")
    ids, weights = ids[:tokens, :k], weights[:tokens, :k]
    module = MXFP8Experts(gate_up, down)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    for y in (mxgemm.moe_experts(x, ids, weights, gate_up, down), module(x, ids, weights), compiled(x, ids, weights)):
        assert y.shape == (tokens, H) and y.dtype == x.dtype and not y.any()


def test_fp32_activations_run_in_bf16_and_answer_fp32():
    (gate_up, down), _ = _experts()
    x = random_act(5, H, dtype=torch.float32)
    ids, weights = _routing(5, 2, "random")
    y = mxgemm.moe_experts(x, ids, weights, gate_up, down)
    assert y.dtype == torch.float32
    assert torch.equal(y, mxgemm.moe_experts(x.bfloat16(), ids, weights, gate_up, down).float())


def test_compile_fullgraph_matches_eager():
    (gate_up, down), _ = _experts()
    experts = MXFP8Experts(gate_up, down)
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    x = random_act(6, H)
    for seed in range(3):  # other routings of the same tokens: the same graph
        ids, weights = _routing(6, 2, "random", seed)
        assert torch.equal(compiled(x, ids, weights), experts(x, ids, weights))


class _Layer(nn.Module):
    def __init__(self, experts: MXFP8Experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, ids, weights):
        return self.experts(x, ids, weights)


def test_a_compiled_experts_module_guards_only_plain_values_of_its_own():
    """A traced MXFP8Experts reads only plain values in its own __dict__, as MXFP8Linear does: with Dynamo's recursive
    dict tags (on by default in torch 2.11) its guards are skipped while that __dict__ is unchanged; a read through
    the prepared weights would make each of their guards run on every step of a compiled model."""
    torch._dynamo.reset()
    layer = _Layer(MXFP8Experts(*_experts()[0]))
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x, (ids, weights) = random_act(5, H), _routing(5, 2, "random")
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True), torch.no_grad():
        assert torch.equal(compiled(x, ids, weights), layer(x, ids, weights))
        safe = guards_tag_safe(_Layer.forward.__code__)
    assert [tag_safe for source, tag_safe in safe.items() if source.endswith("['experts']")] == [True]
    torch._dynamo.reset()


def test_the_modules_weights_are_read_only():
    """What a traced call reads is the module's own copy of its weights' op arguments: a weight cannot be swapped
    under it."""
    (gate_up, down), _ = _experts()
    experts = MXFP8Experts(gate_up, down)
    assert experts.gate_up is gate_up and experts.down is down
    with pytest.raises(AttributeError):
        experts.gate_up = down


def _call(experts: MXFP8Experts, seed: int = 0) -> torch.Tensor:
    ids, weights = _routing(5, 2, "random", seed)
    return experts(random_act(5, H, seed=seed), ids, weights)


def test_a_state_dict_round_trip_re_prepares_the_experts():
    a, b = (MXFP8Experts(*_experts(seed)[0], backend="emulation") for seed in (1, 2))
    b.load_state_dict(a.state_dict())
    assert torch.equal(_call(b), _call(a))
    assert set(a.state_dict()) == {"gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"}
    assert b.backend == "emulation" and b.gate_up is not a.gate_up
    model = _tiny("qwen3_moe").to(torch.bfloat16)
    mxgemm.quantize_model(model, backend="emulation")
    fresh = _tiny("qwen3_moe").to(torch.bfloat16)
    mxgemm.quantize_model(fresh, backend="emulation")
    fresh.load_state_dict(model.state_dict())
    _assert_same_experts_and_logits(fresh, model, seed=3)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda sd: sd.pop("down_proj_scale"), "gate_up_proj, gate_up_proj_scale, down_proj and down_proj_scale must"),
        (lambda sd: sd.update(down_proj=sd["down_proj"][:2]), r"down_proj and its scale: scale shape"),
        (
            lambda sd: sd.update(down_proj=sd["down_proj"][:2], down_proj_scale=sd["down_proj_scale"][:2]),
            r"down_proj and its scale: must be \[4, 64, 96\], got \[2, 64, 96\]",
        ),
        (lambda sd: sd.update(gate_up_proj=sd["gate_up_proj"].float()), "gate_up_proj and its scale: MXFP8 elements"),
    ],
)
def test_a_state_dict_of_other_experts_is_refused_and_the_weights_kept(change, message):
    """Half of the four MX tensors, or tensors of other shapes or dtypes, would leave the experts built from a mix of
    new and old tensors or fail in the kernel: refused, even where missing keys are allowed."""
    a, b = (MXFP8Experts(*_experts(seed)[0], backend="emulation") for seed in (1, 2))
    before, prepared = _call(b), b.gate_up
    state = a.state_dict()
    change(state)
    with pytest.raises(RuntimeError, match=message):
        b.load_state_dict(state, strict=False)
    assert b.gate_up is prepared and torch.equal(_call(b), before)


def test_a_graphed_blocks_state_changes_with_new_weights_even_where_their_ids_come_back(monkeypatch):
    """The state a graphed MoE block keys its graphs on tells new prepared weights from old by the number each layer
    gives the weights it holds, not by the objects' ids alone (CPython hands freed objects' ids to new ones)."""
    from mxgemm import moe_blocks

    model = _tiny("qwen2_moe").to(torch.bfloat16)  # a shared expert: MXFP8Linear layers inside the block too
    mxgemm.quantize_model(model, backend="emulation")
    block = model.model.layers[0].mlp
    assert moe_blocks.is_graphed_block(block)
    monkeypatch.setattr(moe_blocks, "id", lambda _: 0, raising=False)  # every id the same
    state = moe_blocks._state(block)
    assert moe_blocks._state(block) == state
    block.experts.load_state_dict(block.experts.state_dict())
    assert moe_blocks._state(block) != state
    state = moe_blocks._state(block)
    block.shared_expert.down_proj.load_state_dict(block.shared_expert.down_proj.state_dict())
    assert moe_blocks._state(block) != state


def test_module_dtype_casts_keep_the_quantized_experts():
    experts = MXFP8Experts(*_experts()[0])
    before, prepared = _call(experts), experts.gate_up
    for cast in (torch.float16, torch.bfloat16, torch.float32):
        assert experts.to(cast) is experts and experts.gate_up is prepared
    assert torch.equal(_call(experts), before)


def _tiny(kind):
    common = dict(vocab_size=128, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if kind == "qwen3_moe":
        return tiny_qwen3_moe(hidden=H, width=I, experts=E).float()
    if kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=I,
            num_experts=E,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=64,
        )
        return transformers.Qwen2MoeForCausalLM(config)
    if kind == "deepseek_v3":  # multi-head latent attention, a shared expert, a router with a score correction
        config = transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4},
            intermediate_size=128,
            moe_intermediate_size=I,
            n_routed_experts=E,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
        )
        return transformers.DeepseekV3ForCausalLM(config)
    config = transformers.MixtralConfig(**common, intermediate_size=I, num_local_experts=E, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def _assert_same_experts_and_logits(got: nn.Module, want: nn.Module, seed: int) -> None:
    """Every MXFP8Experts of ``got`` holds the bits of ``want``'s, and the two models compute the same logits."""
    experts = {n: m for n, m in want.named_modules() if isinstance(m, MXFP8Experts)}
    assert experts and all(isinstance(got.get_submodule(n), MXFP8Experts) for n in experts)
    for name, module in experts.items():
        for t in ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"):
            mine, theirs = getattr(got.get_submodule(name), t), getattr(module, t)
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), f"{name}.{t}"
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_quantize_model_takes_the_experts_and_keeps_the_routers(kind):
    torch.manual_seed(0)
    model = _tiny(kind).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    report = mxgemm.quantize_model(model, backend="emulation")
    experts = [n for n, m in model.named_modules() if isinstance(m, MXFP8Experts)]
    assert experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert "2 of 2 experts modules (mixture of experts)" in str(report)
    routers = [m for n, m in model.named_modules() if n.endswith(("mlp.gate", "shared_expert_gate"))]
    assert routers and all(not isinstance(m, mxgemm.MXFP8Linear) for m in routers)
    if kind == "qwen2_moe":  # the shared expert is a dense MLP: quantized; its gate routes: kept, and said so
        assert isinstance(model.model.layers[0].mlp.shared_expert.gate_proj, mxgemm.MXFP8Linear)
        assert "skipped model.layers.0.mlp.shared_expert_gate: routes a mixture of experts" in str(report)
    if kind == "deepseek_v3":  # its shared experts are a dense MLP too
        assert isinstance(model.model.layers[0].mlp.shared_experts.down_proj, mxgemm.MXFP8Linear)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, expected = model(ids).logits, reference(ids).logits
    assert torch.isfinite(logits).all() and sqnr_db(logits.float(), expected.float()) >= 20
    state = model.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert state["model.layers.0.mlp.experts.gate_up_proj_scale"].shape == (E, 2 * I, H // 32)
    assert state["model.layers.0.mlp.experts.down_proj"].shape == (E, H, I)


def test_experts_mxgemm_cannot_take_are_left_with_the_reason():
    torch.manual_seed(0)
    model = _tiny("qwen3_moe").to(torch.bfloat16)
    model.model.layers[1].mlp.experts.act_fn = nn.GELU()
    report = mxgemm.quantize_model(model, backend="emulation", skip=("lm_head", "model.layers.0.mlp.experts"))
    assert not any(isinstance(m, MXFP8Experts) for m in model.modules())
    text = str(report)
    assert "replaced 8 of 9 linear layers, 0 of 2 experts modules" in text
    assert "skipped model.layers.0.mlp.experts: matches skip" in text
    assert "skipped model.layers.1.mlp.experts: its activation is GELU, not SiLU" in text


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda m: setattr(m, "gate_up_proj_bias", nn.Parameter(torch.zeros(E, 2 * I))), "its projections have biases"),
        (lambda m: setattr(m, "down_proj", nn.Parameter(torch.zeros(E, H, 7))), "does not match gate_up_proj"),
        (lambda m: setattr(m, "act_fn", nn.ReLU()), "its activation is ReLU, not SiLU"),
        (lambda m: setattr(m, "scale", nn.Parameter(torch.ones(E))), "it holds scale besides its projections"),
        (lambda m: setattr(m, "norm", nn.LayerNorm(H)), "it holds norm.weight, norm.bias, norm besides"),
    ],
)
def test_unfit_experts_are_named_with_the_reason(change, reason):
    experts = _tiny("qwen3_moe").model.layers[0].mlp.experts
    assert experts_unfit_reason(experts) == ""
    change(experts)
    assert reason in experts_unfit_reason(experts)
    with pytest.raises(TypeError, match=f"cannot become MXFP8Experts: .*{re.escape(reason)}"):
        MXFP8Experts.from_experts(experts, backend="emulation")


def _own_experts(model_type, cls, *args, **sizes):
    """transformers' own experts class ``cls`` of ``model_type`` at tiny sizes (E experts, H hidden, I wide; its
    config's other fields at their defaults but ``sizes``), weights seeded; a skip where this transformers lacks it."""
    import importlib

    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        config = transformers.AutoConfig.for_model(model_type)
    except (ImportError, ValueError):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    config = getattr(config, "text_config", config)
    fields = dict(num_local_experts=E, n_routed_experts=E, num_experts=E, hidden_size=H, moe_hidden_size=H)
    for name, value in {**fields, "intermediate_size": I, "moe_intermediate_size": I, **sizes}.items():
        setattr(config, name, value)
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = getattr(module, cls)(config, *args)
    for weight in experts.parameters():
        nn.init.normal_(weight, std=0.05)
    return experts


@pytest.mark.parametrize(
    "model_type, cls, args, sizes, reason",
    [
        # a SwiGLU clamped at swiglu_limit in the class's own _apply_gate
        ("deepseek_v4", "DeepseekV4Experts", (), {"swiglu_limit": 10.0}, "its own _apply_gate is not silu(gate) * up"),
        ("step3p7", "Step3p7Experts", (0,), {"swiglu_limits": [7.0]}, "its own _apply_gate is not silu(gate) * up"),
        ("muse_spark", "MuseSparkExperts", (), {"post_norm_eps": 1e-5}, "it normalizes each expert's output"),
        ("gpt_oss", "GptOssExperts", (), {}, "its weights are stored transposed"),
        ("llama4", "Llama4TextExperts", (), {}, "its weights are stored transposed"),
    ],
)
def test_experts_computing_other_than_silu_gate_times_up_are_refused(model_type, cls, args, sizes, reason):
    experts = _own_experts(model_type, cls, *args, **sizes)
    assert reason in experts_unfit_reason(experts)
    with pytest.raises(TypeError, match=f"cannot become MXFP8Experts: .*{re.escape(reason)}"):
        MXFP8Experts.from_experts(experts, backend="emulation")


@pytest.mark.parametrize(
    "model_type, cls, args, sizes",
    [
        ("beam", "BeamExperts", (), {}),  # its own _apply_gate is silu(gate) * up computed in fp32
        ("step3p7", "Step3p7Experts", (0,), {"swiglu_limits": [0]}),  # a layer whose limit 0 means no clamp
    ],
)
def test_experts_whose_own_gate_is_silu_gate_times_up_are_taken(model_type, cls, args, sizes):
    experts = _own_experts(model_type, cls, *args, **sizes)
    assert experts_unfit_reason(experts) == ""
    x = random_act(9, H, dtype=torch.float32)
    ids, weights = _routing(9, 2, "random")
    with torch.no_grad():
        got = MXFP8Experts.from_experts(experts, backend="emulation")(x, ids, weights)
        assert sqnr_db(got, experts(x, ids, weights)) >= 20


def test_mxfp8_experts_computing_otherwise_load_dequantized_into_their_own(tmp_path, monkeypatch):
    """A tiny DeepSeek-V4, whose checkpoints name its tensors otherwise than its modules: `mxgemm quantize` quantizes
    its linear layers under those names, and both routes load them. Its experts clamp their SwiGLU: with them
    quantized per expert (compressed-tensors' own bytes), load_checkpoint dequantizes them into the model's own
    experts, which keep the clamp, and the report says why; transformers' route refuses them naming load_checkpoint."""
    pytest.importorskip("compressed_tensors")
    from helpers import compressed_tensors_mxfp8
    from safetensors.torch import load_file, save_file

    from mxgemm.cli import main
    from mxgemm.format import MXTensor
    from mxgemm.integrations import checkpoint_config

    _own_experts("deepseek_v4", "DeepseekV4Experts")  # a skip where this transformers has no DeepSeek-V4
    monkeypatch.setenv("MXGEMM_BACKEND", "emulation")  # both routes' layers
    sizes = dict(hidden_size=H, intermediate_size=I, moe_intermediate_size=I, num_local_experts=E, n_routed_experts=E)
    layers = dict(num_hidden_layers=2, layer_types=["compressed_sparse_attention"] * 2, mlp_layer_types=["moe"] * 2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts_per_tok=2)
    config = transformers.AutoConfig.for_model("deepseek_v4", **sizes, **layers, **heads, swiglu_limit=0.1)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "mx")]) == 0  # the experts stay bf16: unfit
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # its checkpoint names (DeepSeek's own: ffn.shared_experts.w1, ...) read by both routes
        want = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        mxgemm.load_checkpoint(want, tmp_path / "mx")
        got = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "mx", config=checkpoint_config(tmp_path / "mx"), dtype=torch.bfloat16
        )
        assert isinstance(got.model.layers[0].mlp.shared_experts.down_proj, mxgemm.MXFP8Linear)
        assert torch.equal(got(ids).logits, want(ids).logits)
    shard = tmp_path / "mx" / "model.safetensors"
    tensors = load_file(str(shard))
    experts = [k for k in tensors if re.search(r"experts\.\d+\.w[123]\.weight$", k)]  # DeepSeek's names
    assert len(experts) == 2 * E * 3
    for k in experts:  # as compressed-tensors quantizes each expert's projection
        tensors[k], tensors[f"{k}_scale"] = compressed_tensors_mxfp8(tensors[k])
    save_file(tensors, str(shard), metadata={"format": "pt"})

    loaded = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    report = mxgemm.load_checkpoint(loaded, tmp_path / "mx")
    own = "its own _apply_gate is not silu(gate) * up"
    assert f"model.layers.0.mlp.experts in bf16: {own}" in str(report)
    held = loaded.model.layers[0].mlp.experts
    assert type(held).__name__ == "DeepseekV4Experts" and held.gate_up_proj.dtype == torch.bfloat16
    prefix = "model.layers.0.ffn.experts.1"  # its gate w1, its up w3
    want = [
        mxgemm.dequantize(MXTensor(tensors[f"{prefix}.{p}.weight"], tensors[f"{prefix}.{p}.weight_scale"]))
        for p in ("w1", "w3")
    ]
    assert torch.equal(held.gate_up_proj[1].float(), torch.cat(want))
    with torch.no_grad():
        assert sqnr_db(loaded(ids).logits.float(), model(ids).logits.float()) >= 20
    with pytest.raises(mxgemm.CheckpointError, match=f"{re.escape(own)} .*; mxgemm.load_checkpoint loads them"):
        transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "mx", config=checkpoint_config(tmp_path / "mx"), dtype=torch.bfloat16
        )


def test_mxgemm_quantize_of_a_vision_moe_model_builds_the_class_its_config_names(tmp_path, monkeypatch):
    """A tiny Qwen3-VL-MoE folder (its text model's tensors under ``model.language_model``): `mxgemm quantize` builds
    the class ``architectures`` names, quantizes the linear layers under the folder's names (it had built the bare
    model and found no tensor for them), says its stacked experts stay as stored, and both routes load it alike."""
    from mxgemm.cli import main
    from mxgemm.integrations import checkpoint_config

    if not hasattr(transformers, "Qwen3VLMoeForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3-VL-MoE")
    monkeypatch.setenv("MXGEMM_BACKEND", "emulation")
    config = transformers.AutoConfig.for_model("qwen3_vl_moe")
    text = dict(hidden_size=H, intermediate_size=128, moe_intermediate_size=I, num_hidden_layers=2, head_dim=16)
    text |= dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=128, num_experts=E, num_experts_per_tok=2)
    vision = dict(depth=1, hidden_size=H, intermediate_size=128, num_heads=4, out_hidden_size=H)
    for part, sizes in ((config.text_config, text), (config.vision_config, vision | {"deepstack_visual_indexes": []})):
        for name, value in sizes.items():
            setattr(part, name, value)
    config.text_config.rope_parameters["mrope_section"] = [2, 3, 3]  # of head_dim 16
    torch.manual_seed(0)
    transformers.Qwen3VLMoeForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "mx")]) == 0
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
        report = mxgemm.load_checkpoint(want, tmp_path / "mx")
        got = transformers.AutoModelForImageTextToText.from_pretrained(
            tmp_path / "mx", config=checkpoint_config(tmp_path / "mx"), dtype=torch.bfloat16
        )
        assert isinstance(got.model.language_model.layers[1].self_attn.o_proj, mxgemm.MXFP8Linear)
        assert torch.equal(got(input_ids=ids).logits, want(input_ids=ids).logits)
    assert "14 MXFP8 layers loaded" in str(report)  # 2 x (q, k, v, o) and the vision tower's 6


def test_stacked_experts_stored_under_other_names_load_by_both_routes(tmp_path, monkeypatch):
    """A tiny GraniteMoe, whose checkpoints store its stacked experts as ``block_sparse_moe.input_linear`` /
    ``output_linear`` (its converters rename them): `mxgemm quantize` keeps them as stored and says why, and both
    routes load them (load_checkpoint had found no tensor of the model under those names)."""
    from mxgemm.cli import main
    from mxgemm.integrations import checkpoint_config

    monkeypatch.setenv("MXGEMM_BACKEND", "emulation")
    sizes = dict(vocab_size=128, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4)
    config = transformers.GraniteMoeConfig(**sizes, num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "mx")]) == 0
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        mxgemm.load_checkpoint(want, tmp_path / "mx")
        got = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "mx", config=checkpoint_config(tmp_path / "mx"), dtype=torch.bfloat16
        )
        experts = [m.model.layers[1].block_sparse_moe.experts.gate_up_proj for m in (want, model)]
        assert torch.equal(*experts)
        assert torch.equal(got(ids).logits, want(ids).logits)
        assert sqnr_db(want(ids).logits.float(), model(ids).logits.float()) >= 20


def test_a_gated_mlp_of_linear_layers_named_gate_up_proj_is_no_experts_module(tmp_path):
    """Phi-3's MLP holds nn.Linear layers named ``gate_up_proj`` and ``down_proj``: they are quantized as linear
    layers, and neither the report nor the checkpoint's ``ignore`` counts the MLP as experts left in bf16."""
    import json

    from mxgemm.cli import main

    sizes = dict(vocab_size=128, hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**sizes, num_key_value_heads=2, pad_token_id=0))
    model.save_pretrained(tmp_path / "src")
    report = str(mxgemm.quantize_model(model, backend="emulation"))
    assert "replaced 8 of 9 linear layers" in report and "experts" not in report
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "mx")]) == 0
    assert json.loads((tmp_path / "mx" / "config.json").read_text())["quantization_config"]["ignore"] == ["lm_head"]


def test_save_checkpoint_writes_the_experts_per_expert(tmp_path):
    """As compressed-tensors and ModelOpt store experts: each expert's gate, up and down projections with their
    scales, the same bits the module computes with; the experts are not in ignore, the routers are."""
    import json

    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = _tiny("qwen3_moe").to(torch.bfloat16)
    mxgemm.quantize_model(model, backend="emulation")
    mxgemm.save_checkpoint(model, tmp_path, config=model.config.to_dict())
    stored = load_file(str(tmp_path / "model.safetensors"))
    experts = model.model.layers[1].mlp.experts
    gate_up, scale = experts.gate_up_proj, experts.gate_up_proj_scale
    prefix = "model.layers.1.mlp.experts"
    for e in range(E):
        assert torch.equal(stored[f"{prefix}.{e}.gate_proj.weight"].view(torch.uint8), gate_up[e, :I].view(torch.uint8))
        assert torch.equal(stored[f"{prefix}.{e}.up_proj.weight_scale"], scale[e, I:])
        assert stored[f"{prefix}.{e}.down_proj.weight"].shape == (H, I)
    assert not any(k.endswith(("gate_up_proj", "gate_up_proj_scale")) for k in stored)
    ignore = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.1.mlp.gate" in ignore and not any("experts" in n for n in ignore)


@pytest.mark.parametrize("experts_quantized", [True, False])
def test_a_moe_checkpoint_loads_back_into_the_same_model(tmp_path, experts_quantized):
    """save_checkpoint's per-expert experts load back with load_checkpoint: MXFP8 ones into MXFP8Experts of the
    same bits, bf16 ones stacked into the model's own 3-D experts; the logits are the saved model's."""
    torch.manual_seed(0)
    model = _tiny("qwen3_moe").to(torch.bfloat16)
    mxgemm.quantize_model(model, backend="emulation", experts=experts_quantized)
    mxgemm.save_checkpoint(model, tmp_path, config=model.config.to_dict())
    fresh = _tiny("qwen3_moe").to(torch.bfloat16)
    report = mxgemm.load_checkpoint(fresh, tmp_path, backend="emulation")
    assert (f"{2 if experts_quantized else 0} MXFP8 experts modules" in str(report)) is experts_quantized
    kinds = {type(m).__name__ for n, m in fresh.named_modules() if n.endswith("mlp.experts")}
    assert kinds == {"MXFP8Experts" if experts_quantized else "Qwen3MoeExperts"}
    if experts_quantized:
        _assert_same_experts_and_logits(fresh, model, seed=2)
        return
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_a_moe_checkpoint_missing_an_expert_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    model = _tiny("qwen3_moe").to(torch.bfloat16)
    mxgemm.quantize_model(model, backend="emulation")
    mxgemm.save_checkpoint(model, tmp_path, config=model.config.to_dict())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    fresh = _tiny("qwen3_moe").to(torch.bfloat16)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(mxgemm.CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight is missing"):
        mxgemm.load_checkpoint(fresh, tmp_path, backend="emulation")
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


@pytest.mark.parametrize("skip_experts", [False, True])
def test_mxgemm_quantize_of_a_moe_model_loads_as_quantize_model_computes(tmp_path, skip_experts):
    """`mxgemm quantize` (per-expert MXFP8 experts, or bf16 ones with --skip) and load_checkpoint give the model that
    quantize_model makes of the same weights: the same logits."""
    from mxgemm.cli import main

    torch.manual_seed(0)
    _tiny("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    skip = ["--skip", "lm_head", "*.experts"] if skip_experts else []
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "mx"), *skip]) == 0
    auto = transformers.AutoModelForCausalLM
    reference = auto.from_pretrained(tmp_path / "src")
    mxgemm.quantize_model(reference, backend="emulation", experts=not skip_experts)
    loaded = auto.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "src"), dtype=torch.bfloat16)
    mxgemm.load_checkpoint(loaded, tmp_path / "mx", backend="emulation")
    assert isinstance(loaded.model.layers[1].mlp.experts, MXFP8Experts) is not skip_experts
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_mxgemm_quantize_of_mixtral_writes_its_experts_under_mixtrals_names(tmp_path):
    """A Mixtral folder stores experts as ``block_sparse_moe.experts.<e>.{w1,w3,w2}.weight``: `mxgemm quantize`
    quantizes them under those names (what vLLM's and transformers' Mixtral loaders read), its ``ignore`` names the
    routers as the checkpoint names them and nothing wider, and from_pretrained(config=checkpoint_config(path)) and
    load_checkpoint (reading the stored names as the model's) load MXFP8Experts computing what quantize_model makes
    of the same weights."""
    import json

    from safetensors import safe_open

    from mxgemm.cli import main
    from mxgemm.integrations import checkpoint_config

    torch.manual_seed(0)
    _tiny("mixtral").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "mx")]) == 0
    with safe_open(tmp_path / "mx" / "model.safetensors", "pt") as f:
        prefix = "model.layers.1.block_sparse_moe.experts.3"
        assert {f.get_slice(f"{prefix}.{w}.weight").get_dtype() for w in ("w1", "w2", "w3")} == {"F8_E4M3"}
        assert f.get_slice(f"{prefix}.w2.weight_scale").get_shape() == [H, I // 32]
        assert not any(".mlp." in k for k in f.keys())
    ignore = json.loads((tmp_path / "mx" / "config.json").read_text())["quantization_config"]["ignore"]
    assert sorted(ignore) == ["lm_head", *(f"model.layers.{i}.block_sparse_moe.gate" for i in range(2))]
    auto = transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path / "mx", config=checkpoint_config(tmp_path / "mx"), dtype=torch.bfloat16)
    assert isinstance(loaded.model.layers[1].mlp.experts, MXFP8Experts)
    reference = auto.from_pretrained(tmp_path / "src")
    mxgemm.quantize_model(reference, experts=True)
    fresh = auto.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "src"), dtype=torch.bfloat16)
    report = mxgemm.load_checkpoint(fresh, tmp_path / "mx")
    assert report.experts == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts"), report
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)
        assert torch.equal(fresh(ids).logits, reference(ids).logits)


def test_mxgemm_quantize_writes_compressed_tensors_own_bytes_for_each_expert(tmp_path):
    """``--scale-mode compressed-tensors``: every expert's gate, up and down projection is stored as the bytes
    compressed-tensors' own MXFP8 quantization gives for that expert's bf16 weight."""
    pytest.importorskip("compressed_tensors")
    from helpers import compressed_tensors_mxfp8
    from safetensors.torch import load_file

    from mxgemm.cli import main

    torch.manual_seed(0)
    model = _tiny("qwen3_moe").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "mx"), "--scale-mode", "compressed-tensors"]) == 0
    stored = load_file(str(tmp_path / "mx" / "model.safetensors"))
    for layer in model.model.layers:
        experts, prefix = layer.mlp.experts, f"model.layers.{layer.self_attn.layer_idx}.mlp.experts"
        for e in range(E):
            for proj, w in (
                ("gate_proj", experts.gate_up_proj[e, :I]),
                ("up_proj", experts.gate_up_proj[e, I:]),
                ("down_proj", experts.down_proj[e]),
            ):
                q, s = compressed_tensors_mxfp8(w.detach())
                assert torch.equal(stored[f"{prefix}.{e}.{proj}.weight"].view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(stored[f"{prefix}.{e}.{proj}.weight_scale"], s)


def test_a_modelopt_moe_checkpoint_loads_the_same_experts(tmp_path):
    """The tensors `mxgemm quantize` writes, as a ModelOpt MXFP8 checkpoint (hf_quant_config.json): load_checkpoint
    gives the same MXFP8Experts bits and logits as from the compressed-tensors layout."""
    import json

    from mxgemm.cli import main

    torch.manual_seed(0)
    _tiny("qwen3_moe").to(torch.bfloat16).save_pretrained(tmp_path / "src")
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "ct")]) == 0
    opt = tmp_path / "modelopt"
    opt.mkdir()
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    ignore = config.pop("quantization_config")["ignore"]
    (opt / "config.json").write_text(json.dumps(config))
    quant = {"quant_algo": "MXFP8", "exclude_modules": ignore}
    (opt / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    (opt / "model.safetensors").write_bytes((tmp_path / "ct" / "model.safetensors").read_bytes())
    models = {}
    for layout in ("ct", "modelopt"):
        models[layout] = _tiny("qwen3_moe").to(torch.bfloat16)
        report = mxgemm.load_checkpoint(models[layout], tmp_path / layout, backend="emulation")
        assert report.experts == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
    assert report.format.kind == "modelopt"
    _assert_same_experts_and_logits(models["modelopt"], models["ct"], seed=5)


@pytest.mark.parametrize("kind", ["qwen2_moe", "deepseek_v3"])
def test_the_transformers_route_saves_and_loads_quantized_experts(tmp_path, kind):
    """MXFP8Config(experts=True), save_pretrained, from_pretrained: the experts come back as MXFP8Experts of the same
    bits (transformers' converters for these models stack gate/up/down per expert), the logits the same."""
    from mxgemm.integrations import MXFP8Config

    torch.manual_seed(0)
    _tiny(kind).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(tmp_path / "bf16", quantization_config=MXFP8Config(experts=True, backend="emulation"))
    model.save_pretrained(tmp_path / "mx")
    _assert_same_experts_and_logits(auto.from_pretrained(tmp_path / "mx"), model, seed=6)


def test_an_atomic_quantization_failing_at_the_experts_leaves_the_model_as_it_was(monkeypatch):
    """The experts are built after the linear layers: with ``atomic=True`` a failure at the second experts module
    leaves every linear layer and experts module as it was."""
    real, calls = MXFP8Experts.from_experts, []

    def from_experts(module, **kwargs):
        calls.append(module)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return real(module, **kwargs)

    monkeypatch.setattr(MXFP8Experts, "from_experts", from_experts)
    model = _tiny("qwen3_moe").to(torch.bfloat16)
    with pytest.raises(torch.OutOfMemoryError):
        mxgemm.quantize_model(model, backend="emulation", atomic=True)
    assert not any(isinstance(m, (mxgemm.MXFP8Linear, MXFP8Experts)) for m in model.modules())
    assert len(calls) == 2


def test_a_named_backend_runs_the_experts_or_leaves_them_with_its_reason():
    """``triton`` runs grouped weights in w8a8-block (under the interpreter here): asked for w8a16, which it computes
    for dense weights only, it leaves the experts in bf16 and says why; asked for nothing, it takes them."""
    from helpers import skip_unless_backend_runs

    skip_unless_backend_runs("triton")
    model = _tiny("qwen3_moe").to(torch.bfloat16)
    report = mxgemm.quantize_model(model, backend="triton", recipe="w8a16")
    assert isinstance(model.model.layers[0].self_attn.q_proj, mxgemm.MXFP8Linear)
    assert not any(isinstance(m, MXFP8Experts) for m in model.modules())
    reason = "triton: computes grouped weights in w8a8-block, not the requested recipe w8a16"
    assert f"skipped model.layers.0.mlp.experts: {reason}" in str(report)
    model = _tiny("qwen3_moe").to(torch.bfloat16)
    mxgemm.quantize_model(model, backend="triton")
    experts = [m for m in model.modules() if isinstance(m, MXFP8Experts)]
    assert len(experts) == 2 and {(m.backend, m.recipe) for m in experts} == {("triton", "w8a8-block")}


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"])
def test_quantize_model_graphs_each_moe_block_and_keeps_its_class_name_and_state(kind, tmp_path):
    """Each MoE block holding MXFP8Experts becomes a graphed subclass of its own class (same name, same state dict,
    the same logits as the unfused model's on CPU, where calls run directly); copies and pickles stay graphed, each
    with graphs of its own; ``fuse=False`` graphs nothing."""
    from mxgemm.moe_blocks import GRAPHED_BLOCK, graph_moe_blocks, is_graphed_block

    torch.manual_seed(0)
    model = _tiny(kind).to(torch.bfloat16)
    plain = copy.deepcopy(model)
    report = mxgemm.quantize_model(model, backend="emulation")
    assert not any(is_graphed_block(m) for m in plain.modules())
    mxgemm.quantize_model(plain, backend="emulation", fuse=False)
    blocks = [model.model.layers[i].mlp for i in range(2)]
    assert all(is_graphed_block(b) for b in blocks) and not any(is_graphed_block(m) for m in plain.modules())
    assert type(blocks[0]).__name__ == type(plain.model.layers[0].mlp).__name__
    assert type(blocks[0]).__mro__[1] is type(plain.model.layers[0].mlp)
    assert f"2 MoE blocks{GRAPHED_BLOCK}" in str(report)
    assert report.fusion[-2:] == tuple(f"model.layers.{i}.mlp{GRAPHED_BLOCK}" for i in range(2))
    assert model.state_dict().keys() == plain.state_dict().keys()
    torch.save(model, tmp_path / "model.pt")
    for twin in (copy.deepcopy(model), torch.load(tmp_path / "model.pt", weights_only=False)):
        block = twin.model.layers[0].mlp
        assert type(block) is type(blocks[0]) and graph_moe_blocks(twin) == []
        assert block._mxgemm_block_graphs is not blocks[0]._mxgemm_block_graphs
        ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            assert torch.equal(twin(ids).logits, plain(ids).logits)


def test_a_moe_block_called_on_more_than_the_hidden_states_is_left_with_the_reason():
    from mxgemm.moe_blocks import graph_moe_blocks, is_graphed_block

    class Block(nn.Module):
        def __init__(self, experts):
            super().__init__()
            self.experts = experts

        def forward(self, hidden_states, ids, weights):
            return self.experts(hidden_states, ids, weights)

    holder = nn.Module()
    holder.mlp = Block(MXFP8Experts(*_experts()[0]))
    assert graph_moe_blocks(holder) == ["mlp: not graphed (its forward takes more than the hidden states)"]
    assert not is_graphed_block(holder.mlp)


def test_a_graphed_moe_block_compiles_fullgraph_to_its_own_steps():
    torch._dynamo.reset()
    model = tiny_qwen3_moe(layers=1, hidden=H, width=I, experts=E)
    mxgemm.quantize_model(model, backend="emulation")
    block = model.model.layers[0].mlp
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = random_act(5, H)[None]
    with torch.no_grad():
        assert torch.equal(compiled(x), block(x))
    torch._dynamo.reset()
