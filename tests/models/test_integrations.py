"""mxgemm inside transformers (a registered quantization method) and torchao (a registered quantize_ config), on CPU
with the real packages; byte parity with torchao's MX quantizer."""

import copy
import json
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import mxgemm

transformers = pytest.importorskip("transformers")


def test_import_mxgemm_imports_neither_framework():
    code = (
        "import sys, mxgemm, mxgemm.integrations; print([m for m in ('transformers', 'torchao') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# --- torchao ---------------------------------------------------------------------------------------------------------


def test_torchao_quantize_swaps_linears_like_quantize_model():
    pytest.importorskip("torchao")
    from torchao.quantization import quantize_

    from mxgemm.integrations import MXFP8LinearConfig

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 64, bias=False), nn.Linear(64, 8), nn.Linear(8, 4)
    )
    reference = copy.deepcopy(model)
    quantize_(model, MXFP8LinearConfig(scale_mode="rceil"))
    mxgemm.quantize_model(reference, scale_mode="rceil", skip=())
    kinds = [type(m).__name__ for m in model]
    assert kinds == ["MXFP8Linear", "ReLU", "MXFP8Linear", "MXFP8Linear", "Linear"]  # K = 8: not a multiple of 32
    x = torch.randn(5, 64)
    assert torch.equal(model(x), reference(x))
    assert torch.equal(model[0].weight_scale, reference[0].weight_scale)


def test_torchao_quantize_takes_the_experts_with_the_moe_filter_and_keeps_the_routers():
    """``filter_fn=moe_filter(model)``: the experts become MXFP8Experts and the routers stay, as with quantize_model
    (the same logits); torchao's default filter would take the routers and never reach the experts."""
    pytest.importorskip("torchao")
    from helpers import tiny_qwen3_moe
    from torchao.quantization import quantize_

    from mxgemm.integrations import MXFP8LinearConfig, moe_filter
    from mxgemm.moe import MXFP8Experts

    model = tiny_qwen3_moe()
    reference = copy.deepcopy(model)
    quantize_(model, MXFP8LinearConfig(backend="emulation"), filter_fn=moe_filter(model))
    mxgemm.quantize_model(reference, backend="emulation", skip=(), fuse=False)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.experts, MXFP8Experts) and type(mlp.gate).__name__ != "MXFP8Linear"
    assert isinstance(model.model.layers[0].self_attn.q_proj, mxgemm.MXFP8Linear)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_torchao_config_refuses_what_is_not_a_linear():
    pytest.importorskip("torchao")
    from torchao.quantization import quantize_

    from mxgemm.integrations import MXFP8LinearConfig

    with pytest.raises(TypeError, match=r"nn\.Linear layers and experts modules, got Conv1d"):
        quantize_(nn.Sequential(nn.Conv1d(32, 32, 1)), MXFP8LinearConfig(), filter_fn=lambda m, _: type(m) is nn.Conv1d)


@pytest.mark.parametrize("scale_mode", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_byte_parity_with_torchao_to_mx(scale_mode, dtype):
    """mxgemm.quantize and torchao's to_mx write the same E8M0 scales and E4M3 bytes under each rounding rule, on
    weights of normal range and on blocks spanning 16 decades."""
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    g = torch.Generator().manual_seed(0)
    plain = torch.randn(256, 512, generator=g)
    wide = torch.randn(256, 512, generator=g) * torch.logspace(-8, 8, 512)
    edges = torch.zeros(8, 64)
    edges[1], edges[2], edges[3, :32], edges[4] = 448.0, 480.0, 1.75 * 2**-3, -0.0
    for w in (plain.to(dtype), wide.to(dtype), edges.to(dtype)):
        ours = mxgemm.quantize(w, scale_mode=scale_mode)
        scale, data = to_mx(w, torch.float8_e4m3fn, 32, ScaleCalculationMode(scale_mode))
        assert torch.equal(data.view(torch.uint8), ours.qdata.view(torch.uint8))
        assert torch.equal(scale.view(torch.uint8).reshape(ours.scale.shape), ours.scale.view(torch.uint8))


def test_subnormal_blocks_stay_exact():
    """A block of bf16 subnormals (2^-130) at the smallest scale (2^-127): mxgemm keeps it exactly (E4M3 2^-3 at scale
    2^-127); torchao 0.18's to_mx does not (floor: 2^-131, rceil: 0), the one difference the parity test leaves out."""
    w = torch.full((1, 32), 2.0**-130, dtype=torch.bfloat16)
    t = mxgemm.quantize(w)
    assert int(t.scale[0, 0]) == 0 and torch.equal(mxgemm.dequantize(t).bfloat16(), w)


# --- transformers ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory):
    from helpers import tiny_llama_folder

    return tiny_llama_folder(tmp_path_factory.mktemp("bf16"), layers=2, vocab=256, dtype=torch.bfloat16)


def _linear_kinds(model) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, (nn.Linear, mxgemm.MXFP8Linear))}


def _assert_mxgemm_layers_and_same_logits(model, reference, dtype, seed: int) -> None:
    """The tiny Llama with its 14 projections on mxgemm and lm_head in full precision, answering in ``dtype`` exactly
    what ``reference`` answers."""
    kinds = _linear_kinds(model)
    assert kinds["lm_head"] == "Linear" and sum(kind == "MXFP8Linear" for kind in kinds.values()) == 14
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        logits = model(ids).logits
        assert logits.dtype == dtype and torch.isfinite(logits).all()
        assert torch.equal(logits, reference(ids).logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_from_pretrained_quantizes_online_through_the_registered_method(bf16_llama, dtype):
    from mxgemm.integrations import MXFP8Config

    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(bf16_llama, quantization_config=MXFP8Config(), dtype=dtype)
    reference = auto.from_pretrained(bf16_llama, dtype=dtype)
    mxgemm.quantize_model(reference)
    assert _linear_kinds(model)["model.layers.0.self_attn.q_proj"] == "MXFP8Linear"
    _assert_mxgemm_layers_and_same_logits(model, reference, dtype, seed=1)


@pytest.mark.parametrize("scale_mode", ["rceil", "compressed-tensors"])
def test_the_online_route_quantizes_with_the_scale_mode_it_is_given(bf16_llama, scale_mode):
    """MXFP8Config(scale_mode=...) reaches the quantizer: each layer's scales are that rule's (and not floor's)."""
    from mxgemm.integrations import MXFP8Config

    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(bf16_llama, quantization_config=MXFP8Config(scale_mode=scale_mode))
    plain = auto.from_pretrained(bf16_llama)
    weight = plain.model.layers[0].mlp.down_proj.weight.detach()
    got = model.model.layers[0].mlp.down_proj.weight_scale
    assert torch.equal(got, mxgemm.quantize(weight, scale_mode=scale_mode).scale)
    assert not torch.equal(got, mxgemm.quantize(weight, scale_mode="floor").scale)


def test_a_saved_quantized_model_loads_back_into_mxgemm_layers(bf16_llama, tmp_path):
    from mxgemm.integrations import MXFP8Config

    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(bf16_llama, quantization_config=MXFP8Config(skip=["lm_head", "*.o_proj"]))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "mxgemm" and saved["skip"] == ["lm_head", "*.o_proj"]
    from safetensors import safe_open

    down = model.model.layers[0].mlp.down_proj
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight")  # float8 [N, K] bytes as int32 [N, K/4]
        assert packed.dtype == torch.int32 and packed.shape == (down.out_features, down.in_features // 4)
        assert torch.equal(packed.view(torch.uint8), down.weight.view(torch.uint8))
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").dtype == torch.uint8
        assert f.get_tensor("model.layers.0.self_attn.o_proj.weight").dtype == torch.bfloat16
    loaded = auto.from_pretrained(tmp_path)
    assert _linear_kinds(loaded) == _linear_kinds(model)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    layer = loaded.model.layers[1].mlp.gate_proj
    assert torch.equal(layer.weight.view(torch.uint8), model.model.layers[1].mlp.gate_proj.weight.view(torch.uint8))
    for dtype in (torch.float32, torch.float16):  # the float8 / uint8 tensors load as saved whatever the model dtype
        other = auto.from_pretrained(tmp_path, dtype=dtype)
        assert _linear_kinds(other) == _linear_kinds(model)
        with torch.no_grad():
            logits = other(ids).logits
        assert logits.dtype == dtype and torch.isfinite(logits).all()


DAMAGES = {
    "nan_scale": r"weight / weight_scale .*NaN code 255",
    "nan_element": r"weight / weight_scale .*NaN element",
    "infinite": r"weight / weight_scale .*dequantizes to infinity",
    "missing_scale": r"weight is present but .*\.weight_scale is missing",
    "missing_weight": r"weight_scale is present but .*\.weight is missing",
    "bf16_weight": r"weight has dtype torch.bfloat16; MXFP8 weights are float8_e4m3fn",
    "e8m0_scale": r"weight_scale has dtype torch.float8_e8m0fnu; the config records scales as torch.uint8",
    "short_scale": r"weight_scale has shape \(128, 1\), expected \[128, 2\]",
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_saved_model_is_checked_as_load_checkpoint_checks_it(bf16_llama, tmp_path, damage):
    """The transformers route keeps load_checkpoint's promises: a NaN scale or element, a block that dequantizes to
    infinity, a missing weight or scale (which transformers would leave uninitialised), a weight or scale of another
    dtype (which it would cast by value) or shape is refused naming the layer, never loaded; no layer has changed."""
    from safetensors.torch import load_file, save_file

    from mxgemm.integrations import MXFP8Config

    auto = transformers.AutoModelForCausalLM
    auto.from_pretrained(bf16_llama, quantization_config=MXFP8Config()).save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj"
    weight, scale = f"{name}.weight", f"{name}.weight_scale"
    if damage == "nan_scale":
        tensors[scale][0, 1] = 255
    elif damage == "nan_element":
        tensors[weight].view(torch.uint8)[3, 5] = 0x7F
    elif damage == "infinite":
        tensors[scale][0, 1] = 254
        tensors[weight].view(torch.uint8)[0, 32:64] = 0x7E  # 448 x 2^127
    elif damage.startswith("missing"):
        del tensors[scale if damage == "missing_scale" else weight]
    elif damage == "bf16_weight":
        fp8 = tensors[weight].view(torch.float8_e4m3fn)
        tensors[weight] = mxgemm.dequantize(mxgemm.MXTensor(fp8, tensors[scale])).bfloat16()
    elif damage == "e8m0_scale":
        tensors[scale] = tensors[scale].view(torch.float8_e8m0fnu)
    else:
        tensors[scale] = tensors[scale][:, :1].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(mxgemm.CheckpointError, match=rf"{name}\.{DAMAGES[damage]}"):
        auto.from_pretrained(tmp_path)


def test_a_saved_model_without_mxgemm_imported_is_refused_and_earlier_saves_still_load(bf16_llama, tmp_path):
    """transformers alone (mxgemm.integrations not imported) does not know the method: it refuses the packed weights'
    shape instead of reading float8 bytes as bf16 values. A save of the earlier layout (float8 [N, K] weights) loads
    into the same layers and logits."""
    from safetensors.torch import load_file, save_file

    from mxgemm.integrations import MXFP8Config

    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(bf16_llama, quantization_config=MXFP8Config())
    model.save_pretrained(tmp_path / "new")
    plain = (
        "import transformers\n"
        f"transformers.AutoModelForCausalLM.from_pretrained({str(tmp_path / 'new')!r})\n"
        "print('loaded')\n"
    )
    run = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True)
    assert run.returncode != 0 and "loaded" not in run.stdout and "size mismatch" in run.stderr + run.stdout
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
    tensors = load_file(str(tmp_path / "new" / "model.safetensors"))
    for key, t in tensors.items():
        if t.dtype == torch.int32:
            tensors[key] = t.view(torch.float8_e4m3fn)
    save_file(tensors, str(old / "model.safetensors"), metadata={"format": "pt"})
    loaded = auto.from_pretrained(old)
    assert _linear_kinds(loaded) == _linear_kinds(model)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_registration_is_idempotent_and_the_config_checks_its_method():
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    from mxgemm.integrations import MXFP8Config, MXFP8HfQuantizer, enable_transformers

    enable_transformers()
    enable_transformers()
    assert AUTO_QUANTIZER_MAPPING["mxgemm"] is MXFP8HfQuantizer
    assert MXFP8Config.from_dict({"quant_method": "mxgemm", "scale_mode": "rceil"}).scale_mode == "rceil"
    with pytest.raises(ValueError, match="quant_method"):
        MXFP8Config(quant_method="fp8")


@pytest.fixture(scope="module")
def mx_checkpoints(bf16_llama, tmp_path_factory):
    """The bf16 model as `mxgemm quantize` writes it (compressed-tensors), and the same tensors as a ModelOpt
    checkpoint, and with the scales stored as float8_e8m0fnu."""
    from safetensors.torch import load_file, save_file

    from mxgemm.cli import main

    root = tmp_path_factory.mktemp("mx")
    ct = root / "compressed-tensors"
    assert main(["quantize", str(bf16_llama), str(ct)]) == 0
    cfg = json.loads((ct / "config.json").read_text())
    tensors = load_file(str(ct / "model.safetensors"))
    opt, e8m0 = root / "modelopt", root / "e8m0"
    for folder in (opt, e8m0):
        folder.mkdir()
    (opt / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    quant = {"quant_algo": "MXFP8", "exclude_modules": ["lm_head"]}
    (opt / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    save_file(tensors, str(opt / "model.safetensors"))
    (e8m0 / "config.json").write_text(json.dumps(cfg))
    typed = {k: v.view(torch.float8_e8m0fnu) if k.endswith(".weight_scale") else v for k, v in tensors.items()}
    save_file(typed, str(e8m0 / "model.safetensors"))
    return {"compressed-tensors": ct, "modelopt": opt, "e8m0": e8m0}


@pytest.mark.parametrize("kind", ["compressed-tensors", "modelopt", "e8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_from_pretrained_loads_an_mxfp8_checkpoint_into_mxgemm_layers(mx_checkpoints, kind, dtype):
    """`from_pretrained(path, config=checkpoint_config(path))`: the layers the checkpoint quantizes become
    MXFP8Linear (one copy of the weight), and the model computes what `mxgemm.load_checkpoint` gives, bit for bit."""
    from mxgemm.integrations import checkpoint_config

    path = mx_checkpoints[kind]
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, config=checkpoint_config(path), dtype=dtype)
    layer = model.model.layers[0].mlp.down_proj
    assert layer.prepared.nbytes <= 1.07 * layer.in_features * layer.out_features
    reference = auto.from_config(
        transformers.AutoConfig.from_pretrained(mx_checkpoints["compressed-tensors"]), dtype=dtype
    )
    mxgemm.load_checkpoint(reference, mx_checkpoints["compressed-tensors"])
    _assert_mxgemm_layers_and_same_logits(model, reference, dtype, seed=3)


def test_checkpoint_config_refuses_a_folder_that_is_not_mxfp8_and_layers_the_model_lacks(bf16_llama, mx_checkpoints):
    from mxgemm.integrations import checkpoint_config

    with pytest.raises(mxgemm.CheckpointError, match="no MXFP8 quantization config"):
        checkpoint_config(bf16_llama)
    path = mx_checkpoints["compressed-tensors"]
    config = checkpoint_config(path)
    config.quantization_config["modules"].append("model.layers.0.mlp.act_fn")
    with pytest.raises(ValueError, match=r"quantizes model\.layers\.0\.mlp\.act_fn, which is not an nn\.Linear"):
        transformers.AutoModelForCausalLM.from_pretrained(path, config=config)


def test_checkpoint_config_of_a_moe_checkpoint_loads_the_experts_as_load_checkpoint_does(tmp_path):
    """An MXFP8 mixture-of-experts checkpoint (per-expert float8 tensors and weight_scale, as `mxgemm quantize` and
    compressed-tensors write them): from_pretrained(config=checkpoint_config(path)) stacks them into MXFP8Experts of
    the bits load_checkpoint gives, keeps the routers, and computes the same logits. A missing expert tensor or a
    bf16 one in its place is refused by name before the model changes."""
    from helpers import tiny_qwen3_moe
    from safetensors.torch import load_file, save_file

    from mxgemm.cli import main
    from mxgemm.integrations import checkpoint_config
    from mxgemm.moe import MXFP8Experts

    tiny_qwen3_moe(1).save_pretrained(tmp_path / "bf16")
    assert main(["quantize", str(tmp_path / "bf16"), str(tmp_path / "mx")]) == 0
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(tmp_path / "mx", config=checkpoint_config(tmp_path / "mx"))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, MXFP8Experts) and type(model.model.layers[0].mlp.gate).__name__ == "Qwen3MoeTopKRouter"
    reference = auto.from_config(transformers.AutoConfig.from_pretrained(tmp_path / "bf16"))
    mxgemm.load_checkpoint(reference, tmp_path / "mx")
    for name in ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"):
        want = getattr(reference.model.layers[0].mlp.experts, name)
        assert torch.equal(getattr(experts, name).view(torch.uint8), want.view(torch.uint8)), name
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)

    tensors = load_file(str(tmp_path / "mx" / "model.safetensors"))
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    unread = r"experts\.0\.\w+\.weight_scale is a quantized expert this route does not read"
    damages = [("bf16", re.escape(f"{name} has dtype torch.bfloat16")), ("missing", re.escape(f"{name} is missing"))]
    damages.append(("w1", unread))
    for damage, message in damages:
        damaged = dict(tensors)
        if damage == "bf16":
            damaged[name] = tensors[name].bfloat16()
        elif damage == "missing":
            del damaged[name]
        else:  # Mixtral's names: transformers would load the float8 bytes into bf16 experts by value
            damaged = {k.replace(".gate_proj.", ".w1."): v for k, v in tensors.items()}
        save_file(damaged, str(tmp_path / "mx" / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(mxgemm.CheckpointError, match=message):
            auto.from_pretrained(tmp_path / "mx", config=checkpoint_config(tmp_path / "mx"))


def test_a_moe_model_saved_from_the_online_route_loads_back_the_same(tmp_path):
    """By default the transformers route leaves experts in bf16. With ``experts=True`` it quantizes them as
    quantize_model does (the same logits); save_pretrained writes them per expert (weights packed as int32, as the
    linear layers' are) and from_pretrained loads them back into MXFP8Experts of the same bits and logits."""
    from helpers import tiny_qwen3_moe
    from safetensors import safe_open

    from mxgemm.integrations import MXFP8Config
    from mxgemm.moe import MXFP8Experts

    tiny_qwen3_moe(1).save_pretrained(tmp_path / "bf16")
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(tmp_path / "bf16", quantization_config=MXFP8Config())
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert isinstance(model.model.layers[0].self_attn.q_proj, mxgemm.MXFP8Linear)
    model.save_pretrained(tmp_path / "mx")
    loaded = auto.from_pretrained(tmp_path / "mx")
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    with_experts = auto.from_pretrained(tmp_path / "bf16", quantization_config=MXFP8Config(experts=True))
    assert isinstance(with_experts.model.layers[0].mlp.experts, MXFP8Experts)
    reference = auto.from_pretrained(tmp_path / "bf16")
    mxgemm.quantize_model(reference)
    with torch.no_grad():
        assert torch.equal(with_experts(ids).logits, reference(ids).logits)
    with_experts.save_pretrained(tmp_path / "mx-experts")
    with safe_open(tmp_path / "mx-experts" / "model.safetensors", "pt") as f:
        prefix = "model.layers.0.mlp.experts"
        assert f.get_slice(f"{prefix}.3.up_proj.weight").get_dtype() == "I32"
        assert f.get_slice(f"{prefix}.3.up_proj.weight_scale").get_dtype() == "U8"
        assert not any(k.startswith(f"{prefix}.gate_up_proj") for k in f.keys())
    back = auto.from_pretrained(tmp_path / "mx-experts")
    got, saved = back.model.layers[0].mlp.experts, with_experts.model.layers[0].mlp.experts
    assert isinstance(got, MXFP8Experts)
    for name in ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"):
        assert torch.equal(getattr(got, name).view(torch.uint8), getattr(saved, name).view(torch.uint8)), name
    with torch.no_grad():
        assert torch.equal(back(ids).logits, with_experts(ids).logits)


def test_mixtral_experts_save_under_mixtrals_names_and_load_back(tmp_path, monkeypatch):
    """Mixtral's checkpoints store experts as ``block_sparse_moe.experts.<e>.{w1,w3,w2}``, which transformers'
    converters read: save_pretrained writes quantized experts under those names (with ``weight_scale`` beside each)
    and from_pretrained loads them back into MXFP8Experts of the same bits and logits. Where a model's converters
    would not store its experts one tensor per expert and projection, save_pretrained refuses in one line and writes
    nothing."""
    from safetensors import safe_open

    from mxgemm.integrations import MXFP8Config
    from mxgemm.moe import MXFP8Experts

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    config = transformers.MixtralConfig(**common, intermediate_size=96, num_local_experts=4)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "bf16")
    auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(tmp_path / "bf16", quantization_config=MXFP8Config(experts=True))
    saved = model.model.layers[0].mlp.experts
    assert isinstance(saved, MXFP8Experts)
    model.save_pretrained(tmp_path / "mx")
    with safe_open(tmp_path / "mx" / "model.safetensors", "pt") as f:
        prefix = "model.layers.0.block_sparse_moe.experts"
        assert {f.get_slice(f"{prefix}.3.{w}.weight").get_dtype() for w in ("w1", "w2", "w3")} == {"I32"}
        assert f.get_slice(f"{prefix}.3.w2.weight").get_shape() == [64, 96 // 4]
        assert f.get_slice(f"{prefix}.3.w3.weight_scale").get_dtype() == "U8"
        assert not any(".mlp.experts" in k or "gate_up_proj" in k for k in f.keys())
    back = auto.from_pretrained(tmp_path / "mx")
    got = back.model.layers[0].mlp.experts
    assert isinstance(got, MXFP8Experts)
    for name in ("gate_up_proj", "gate_up_proj_scale", "down_proj", "down_proj_scale"):
        assert torch.equal(getattr(got, name).view(torch.uint8), getattr(saved, name).view(torch.uint8)), name
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)

    import transformers.core_model_loading as loading

    monkeypatch.setattr(loading, "revert_weight_conversion", lambda model, state: state)  # no converters
    refused = r"model\.layers\.0\.mlp\.experts: transformers does not store MixtralForCausalLM's experts one tensor"
    with pytest.raises(mxgemm.MXGemmError, match=refused + r".*mxgemm\.save_checkpoint"):
        model.save_pretrained(tmp_path / "other")
    assert not (tmp_path / "other" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"backend": "fooo"}, mxgemm.UnknownBackendError, "unknown backend 'fooo'"),
        ({"recipe": "w4a4"}, ValueError, "unknown recipe 'w4a4'"),
        ({"scale_mode": "bogus"}, ValueError, "scale_mode must be one of floor, rceil, compressed-tensors"),
    ],
)
def test_both_configs_refuse_a_bad_request_when_made_not_at_first_use(kwargs, error, message):
    pytest.importorskip("torchao")
    from mxgemm.integrations import MXFP8Config, MXFP8LinearConfig

    for config in (MXFP8Config, MXFP8LinearConfig):
        with pytest.raises(error, match=message):
            config(**kwargs)


def test_mxfp8config_reads_a_skip_string_as_one_pattern_and_refuses_other_types():
    from mxgemm.integrations import MXFP8Config

    assert MXFP8Config(skip="lm_head").skip == ["lm_head"]  # not seven letters
    for kwargs in ({"skip": [3]}, {"modules": ["a", None]}, {"experts": "yes"}):
        with pytest.raises(TypeError, match="skip and modules are lists of layer names"):
            MXFP8Config(**kwargs)
