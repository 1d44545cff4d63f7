"""MXFP8 checkpoints: mxgemm quantize -> compressed-tensors parses it -> load_checkpoint gives identical layers."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mxgemm
from mxgemm.checkpoints import read_format
from mxgemm.cli import main

transformers = pytest.importorskip("transformers")


def _tiny_llama_config(tie=False):
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


@pytest.fixture
def llama_dir(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_llama_config())
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, mxgemm.MXFP8Linear))}


@pytest.mark.parametrize("scheme", ["MXFP8", "MXFP8A16"])
def test_round_trip_through_the_cli(llama_dir, tmp_path, scheme, capsys):
    out = tmp_path / "mx"
    assert main(["quantize", str(llama_dir), str(out), "--scheme", scheme]) == 0
    assert "replaced 14 of 15 linear layers" in capsys.readouterr().out  # 2 x (q k v o gate up down); lm_head kept
    fmt = read_format(out)
    assert (fmt.kind, fmt.scheme, fmt.ignore) == ("compressed-tensors", scheme, ("lm_head",))

    # the in-memory reference: the same model quantized online
    ref = transformers.LlamaForCausalLM.from_pretrained(llama_dir)
    mxgemm.quantize_model(ref, backend="emulation")
    loaded = transformers.LlamaForCausalLM(_tiny_llama_config())
    report = mxgemm.load_checkpoint(loaded, out, backend="emulation")
    assert len(report.quantized) == 14 and report.format.scheme == scheme
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        for name, layer in _linears(loaded).items():
            ref_layer = _linears(ref)[name]
            assert type(layer) is type(ref_layer)
            x = torch.randn(5, layer.in_features)
            assert torch.equal(layer(x), ref_layer(x)), name  # bit-identical layer outputs
        assert torch.equal(loaded(ids).logits, ref(ids).logits)


def test_compressed_tensors_parses_and_decompresses_it(llama_dir, tmp_path):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import MXFP8QuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    out = tmp_path / "mx"
    assert main(["quantize", str(llama_dir), str(out), "--scheme", "MXFP8"]) == 0
    qc = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    assert qc.format == "mxfp8-quantized" and qc.ignore == ["lm_head"]
    scheme = qc.config_groups["group_0"]
    preset = preset_name_to_scheme("MXFP8", ["Linear"])
    assert scheme.weights.model_dump() == preset.weights.model_dump()
    assert scheme.input_activations.model_dump() == preset.input_activations.model_dump()
    assert ct.compressors.BaseCompressor.get_value_from_registry(qc.format) is MXFP8QuantizationCompressor
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    w, s = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
    theirs = MXFP8QuantizationCompressor.decompress({"weight": w, "weight_scale": s}, scheme)["weight"]
    ours = mxgemm.dequantize(mxgemm.MXTensor(w, s))
    assert torch.equal(theirs.float(), ours.to(theirs.dtype).float())


def _fp8_layout(mx, folder, scales: str, block=(1, 32)):
    """``mx``'s tensors as an SGLang-style block-FP8 checkpoint: quant_method fp8 with 1x32 blocks, each scale under
    weight_scale_inv, as E8M0 bytes (``scales="uint8"``) or the float32 powers of two they stand for."""
    folder.mkdir()
    cfg = json.loads((mx / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for k, v in load_file(str(mx / "model.safetensors")).items():
        if k.endswith(".weight_scale"):
            k, v = k + "_inv", (torch.exp2(v.float() - 127) if scales == "float32" else v)
        tensors[k] = v
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


@pytest.mark.parametrize("scales", ["uint8", "float32"])
def test_sglang_style_weight_scale_inv_layout_loads(llama_dir, tmp_path, scales):
    """Scales under weight_scale_inv (E8M0 bytes, or float32 powers of two) load into the layers the
    compressed-tensors scales give, bit for bit; float32 scales that are not powers of two, and block-FP8 configs
    of other blocks, are refused by name; so is the transformers route, which would leave weight_scale unloaded."""
    mx = tmp_path / "mx"
    main(["quantize", str(llama_dir), str(mx)])
    tensors = _fp8_layout(mx, tmp_path / "fp8", scales)
    a = transformers.LlamaForCausalLM(_tiny_llama_config())
    b = transformers.LlamaForCausalLM(_tiny_llama_config())
    ra = mxgemm.load_checkpoint(a, mx, backend="emulation")
    rb = mxgemm.load_checkpoint(b, tmp_path / "fp8", backend="emulation")
    assert (rb.format.kind, rb.format.scheme) == ("fp8", "MXFP8") and rb.quantized == ra.quantized
    name = "model.layers.1.mlp.down_proj"
    assert torch.equal(b.get_submodule(name).weight_scale, a.get_submodule(name).weight_scale)
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)
    from mxgemm.integrations import checkpoint_config  # transformers loads by stored names: refused, not half-read

    with pytest.raises(mxgemm.CheckpointError, match=r"weight_scale_inv: scales stored as .*mxgemm\.load_checkpoint"):
        checkpoint_config(tmp_path / "fp8")
    if scales == "float32":
        tensors[f"{name}.weight_scale_inv"][0, 0] = 0.3
        save_file(tensors, str(tmp_path / "fp8" / "model.safetensors"))
        fresh = transformers.LlamaForCausalLM(_tiny_llama_config())
        with pytest.raises(mxgemm.CheckpointError, match=rf"{name}\.weight_scale_inv: float32 scales that are not"):
            mxgemm.load_checkpoint(fresh, tmp_path / "fp8", backend="emulation")
    _fp8_layout(mx, tmp_path / "blocks", scales, block=(128, 128))
    with pytest.raises(mxgemm.CheckpointError, match=r"fp8 weight_block_size \[128, 128\] is not MXFP8's \[1, 32\]"):
        read_format(tmp_path / "blocks")


def test_modelopt_layout_loads(llama_dir, tmp_path):
    mx = tmp_path / "mx"
    main(["quantize", str(llama_dir), str(mx)])
    opt = tmp_path / "modelopt"
    opt.mkdir()
    cfg = json.loads((mx / "config.json").read_text())
    del cfg["quantization_config"]
    (opt / "config.json").write_text(json.dumps(cfg))
    (opt / "hf_quant_config.json").write_text(
        json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "MXFP8", "exclude_modules": ["lm_head"]}}
        )
    )
    save_file(load_file(str(mx / "model.safetensors")), str(opt / "model.safetensors"))
    a = transformers.LlamaForCausalLM(_tiny_llama_config())
    b = transformers.LlamaForCausalLM(_tiny_llama_config())
    ra = mxgemm.load_checkpoint(a, mx, backend="emulation")
    rb = mxgemm.load_checkpoint(b, opt, backend="emulation")
    assert rb.format.kind == "modelopt" and rb.quantized == ra.quantized
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_tied_embeddings_are_written_once_and_retied(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_tiny_llama_config(tie=True))
    model.save_pretrained(tmp_path / "model")
    assert main(["quantize", str(tmp_path / "model"), str(tmp_path / "mx")]) == 0
    loaded = transformers.LlamaForCausalLM(_tiny_llama_config(tie=True))
    report = mxgemm.load_checkpoint(loaded, tmp_path / "mx", backend="emulation")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert len(report.quantized) == 14


L0, O1 = "model.layers.0", "model.layers.1.self_attn.o_proj"


def _set(key, fn):
    return lambda t: t.update({key: fn(t[key])})


@pytest.mark.parametrize(
    "damage, message",
    [
        (_set(f"{L0}.mlp.up_proj.weight_scale", lambda v: v.float()), f"{L0}.mlp.up_proj.weight_scale has dtype"),
        (lambda t: t.pop(f"{O1}.weight_scale"), f"{O1}.weight is float8 but {O1}.weight_scale is missing"),
        (
            _set(f"{L0}.mlp.down_proj.weight_scale", lambda v: v[:, :2].contiguous()),
            rf"{L0}.mlp.down_proj.weight_scale has shape \(64, 2\), expected \[64, 4\]",
        ),
        (_set(f"{L0}.mlp.gate_proj.weight", lambda v: v.bfloat16()), f"{L0}.mlp.gate_proj.weight has dtype"),
        (
            lambda t: t.update({"model.extra.weight_scale": torch.zeros(2, 2, dtype=torch.uint8)}),
            "model.extra.weight_scale belongs to no nn.Linear",
        ),
        (lambda t: t.pop("model.norm.weight"), "the checkpoint has no tensor for model.norm.weight"),
    ],
)
def test_bad_checkpoints_name_the_tensor(llama_dir, tmp_path, damage, message):
    mx = tmp_path / "mx"
    main(["quantize", str(llama_dir), str(mx)])
    tensors = load_file(str(mx / "model.safetensors"))
    damage(tensors)
    save_file(tensors, str(mx / "model.safetensors"))
    with pytest.raises(mxgemm.CheckpointError, match=message):
        mxgemm.load_checkpoint(transformers.LlamaForCausalLM(_tiny_llama_config()), mx, backend="emulation")


def test_not_an_mxfp8_checkpoint(llama_dir):
    with pytest.raises(mxgemm.CheckpointError, match="no MXFP8 quantization config"):
        mxgemm.load_checkpoint(transformers.LlamaForCausalLM(_tiny_llama_config()), llama_dir)


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_quantize_never_loses_the_source_or_the_output(llama_dir, tmp_path, capsys):
    """Same or nested folders, a non-empty output, a missing or already-quantized source, an unwritable output:
    one-line errors, nothing written; --force replaces the output cleanly; a failure leaves no partial checkpoint."""
    (llama_dir / "1_Pooling").mkdir()
    (llama_dir / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (llama_dir / "tokenizer.json").write_text("{}")
    source = _tree(llama_dir)
    for out in (llama_dir, llama_dir / "mx", tmp_path):  # the same folder, inside it, around it
        assert main(["quantize", str(llama_dir), str(out)]) == 2
        assert "must lie apart" in capsys.readouterr().out
    assert main(["quantize", str(tmp_path / "nowhere"), str(tmp_path / "a")]) == 2
    assert "no model folder" in capsys.readouterr().out
    (tmp_path / "file.txt").write_text("x")
    assert main(["quantize", str(llama_dir), str(tmp_path / "file.txt" / "mx")]) == 2  # its parent is a file
    assert len(capsys.readouterr().out.strip().splitlines()) == 1

    out = tmp_path / "mx"
    out.mkdir()
    (out / "model-00001-of-00002.safetensors").write_text("an old shard")
    assert main(["quantize", str(llama_dir), str(out)]) == 2
    assert "not empty" in capsys.readouterr().out and (out / "model-00001-of-00002.safetensors").exists()
    assert main(["quantize", str(llama_dir), str(out), "--force"]) == 0
    written = {p.name for p in out.iterdir()}
    assert written == {"model.safetensors", "config.json", "tokenizer.json", "1_Pooling", "generation_config.json"}
    assert (out / "1_Pooling" / "config.json").read_text() == '{"pooling_mode_mean_tokens": true}'
    assert _tree(llama_dir) == source  # the source untouched throughout
    assert main(["quantize", str(out), str(tmp_path / "mx2")]) == 2
    assert "already quantized" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left


def test_a_failed_quantize_leaves_no_partial_output(llama_dir, tmp_path, monkeypatch):
    import mxgemm.convert

    def broken(writer):
        (writer.folder / "model.safetensors").write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(mxgemm.convert.ShardWriter, "finish", broken)
    out = tmp_path / "mx"
    out.mkdir()
    (out / "keep.txt").write_text("the user's")
    assert main(["quantize", str(llama_dir), str(out), "--force"]) == 2
    assert _tree(out) == {"keep.txt": b"the user's"}  # the old output stands until a new one is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "mx"]


def _mx_checkpoint(llama_dir, tmp_path):
    mx = tmp_path / "mx"
    assert main(["quantize", str(llama_dir), str(mx)]) == 0
    return mx


def _snapshot(model):
    return {k: (type(model.get_submodule(k.rpartition(".")[0])), v.clone()) for k, v in model.state_dict().items()}


def _assert_unchanged(model, before):
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for k, (cls, v) in before.items():
        assert after[k][0] is cls and torch.equal(after[k][1], v), k


@pytest.mark.parametrize(
    "damage", ["nan_scale", "nan_element", "infinite", "two_files", "wrong_shape_late", "no_backend"]
)
def test_a_refused_load_leaves_the_model_as_it_was(llama_dir, tmp_path, damage):
    mx = _mx_checkpoint(llama_dir, tmp_path)
    tensors = load_file(str(mx / "model.safetensors"))
    backend, match = "emulation", None
    if damage == "nan_scale":
        tensors[f"{O1}.weight_scale"][3, 1] = 255
        match = rf"{O1}.weight / weight_scale holds the E8M0 NaN code 255 at \(3, 1\)"
    elif damage == "nan_element":
        tensors[f"{O1}.weight"].view(torch.uint8)[2, 40] = 0xFF  # E4M3's NaN
        match = rf"{O1}.weight / weight_scale holds a NaN element at \(2, 40\)"
    elif damage == "infinite":  # 448 x 2^127 is beyond fp32's range; 1 x 2^127 is not
        weight, scale = tensors[f"{O1}.weight"], tensors[f"{O1}.weight_scale"]
        weight.view(torch.uint8)[5, :32] = 0x38  # 1.0
        scale[5, 0] = 254
        assert torch.isfinite(mxgemm.dequantize(mxgemm.MXTensor(weight, scale))).all()  # 2^127 is not refused
        weight.view(torch.uint8)[5, 7] = 0x7E  # 448
        match = rf"{O1}.weight / weight_scale dequantizes to infinity in the block at \(5, 0\)"
    elif damage == "two_files":
        save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(mx / "model-extra.safetensors"))
        match = "model.norm.weight is in two files, model-extra.safetensors and model.safetensors"
    elif damage == "wrong_shape_late":  # after every quantized layer has been read
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:32].clone()
        match = r"model.norm.weight has shape \(32,\); the model's is \(64,\)"
    else:
        backend, match = "cublas_block", "cublas_block"
    save_file(tensors, str(mx / "model.safetensors"))
    model = transformers.LlamaForCausalLM(_tiny_llama_config())
    before = _snapshot(model)
    with pytest.raises((mxgemm.CheckpointError, mxgemm.BackendUnavailableError), match=match):
        mxgemm.load_checkpoint(model, mx, backend=backend)
    _assert_unchanged(model, before)


def test_unreadable_files_and_meta_models_are_named(llama_dir, tmp_path):
    mx = _mx_checkpoint(llama_dir, tmp_path)
    with torch.device("meta"):
        meta_model = transformers.LlamaForCausalLM(_tiny_llama_config())
    with pytest.raises(mxgemm.CheckpointError, match="meta device"):
        mxgemm.load_checkpoint(meta_model, mx, backend="emulation")
    meta_model.register_buffer("extra_table", torch.empty(3, device="meta"))  # a tensor no checkpoint fills
    with pytest.raises(mxgemm.CheckpointError, match="the checkpoint has no tensor for extra_table"):
        mxgemm.load_checkpoint(meta_model, mx, backend="emulation", device="cpu")
    meta_model.register_buffer("extra_table", torch.empty(3, device="meta"), persistent=False)  # not in a state dict
    with pytest.raises(mxgemm.CheckpointError, match=r"extra_table is on the meta device and not in the checkpoint"):
        mxgemm.load_checkpoint(meta_model, mx, backend="emulation", device="cpu")
    data = (mx / "model.safetensors").read_bytes()
    (mx / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(mxgemm.CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        mxgemm.load_checkpoint(transformers.LlamaForCausalLM(_tiny_llama_config()), mx, backend="emulation")
    (mx / "config.json").write_text('{"quantization_config": ')
    with pytest.raises(mxgemm.CheckpointError, match=r"config\.json: cannot be read as JSON"):
        mxgemm.load_checkpoint(transformers.LlamaForCausalLM(_tiny_llama_config()), mx, backend="emulation")
    with pytest.raises(mxgemm.CheckpointError, match="no such checkpoint folder"):
        mxgemm.load_checkpoint(transformers.LlamaForCausalLM(_tiny_llama_config()), tmp_path / "nope")


def test_a_source_reads_stored_names_as_the_models(tmp_path):
    """TensorSource.rename (load_checkpoint's reading of a transformers model's stored names): a weight's
    ``weight_scale`` follows it, a scale read from ``weight_scale_inv`` is still read as E8M0 bytes, other float32
    tensors keep their values, and a name the files also hold is refused."""
    from safetensors.torch import save_file

    from mxgemm.checkpoints import TensorSource

    tensors = {
        "m.block.experts.0.w1.weight": torch.zeros(4, 32).to(torch.float8_e4m3fn),
        "m.block.experts.0.w1.weight_scale_inv": torch.full((4, 1), 0.25),
        "m.block.gate.weight": torch.full((4, 32), 0.3),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    source = TensorSource(tmp_path)
    source.rename(
        {"m.block.experts.0.w1.weight": "m.mlp.experts.0.gate_proj.weight", "m.block.gate.weight": "m.mlp.gate.weight"}
    )
    assert sorted(source.where) == [
        "m.mlp.experts.0.gate_proj.weight",
        "m.mlp.experts.0.gate_proj.weight_scale",
        "m.mlp.gate.weight",
    ]
    assert torch.equal(
        source.load("m.mlp.experts.0.gate_proj.weight_scale"), torch.full((4, 1), 125, dtype=torch.uint8)
    )
    assert torch.equal(source.load("m.mlp.gate.weight"), torch.full((4, 32), 0.3))
    assert source.load("m.mlp.experts.0.gate_proj.weight").dtype == torch.float8_e4m3fn
    tensors["m.mlp.gate.weight"] = tensors["m.block.gate.weight"].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(mxgemm.CheckpointError, match=r"m\.block\.gate\.weight is read as m\.mlp\.gate\.weight, which"):
        TensorSource(tmp_path).rename({"m.block.gate.weight": "m.mlp.gate.weight"})
