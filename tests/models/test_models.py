"""quantize_model: replaces nn.Linear layers in place and reports each layer."""

import pytest
import torch
from helpers import sqnr_db
from torch import nn

import mxgemm


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.layers = nn.ModuleList([nn.ModuleDict({"q": nn.Linear(64, 64), "o": nn.Linear(64, 64)}) for _ in range(2)])
        self.odd = nn.Linear(40, 64)  # in_features not a multiple of 32
        self.lm_head = nn.Linear(64, 100, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for blk in self.layers:
            h = h + blk["o"](torch.tanh(blk["q"](h)))
        return self.lm_head(h)


def test_replaces_and_reports():
    torch.manual_seed(0)
    net = _Net()
    ids = torch.randint(0, 100, (2, 5))
    ref = net(ids)
    report = mxgemm.quantize_model(net, backend="emulation")
    names = {r.name: r for r in report.layers}
    assert set(names) == {"layers.0.q", "layers.0.o", "layers.1.q", "layers.1.o", "odd", "lm_head"}
    assert [r.name for r in report.replaced] == ["layers.0.q", "layers.0.o", "layers.1.q", "layers.1.o"]
    assert names["lm_head"].reason == "matches skip" and "not a multiple of 32" in names["odd"].reason
    assert all(r.backend == "emulation" and r.recipe == "w8a16" for r in report.replaced)
    assert isinstance(net.layers[1]["o"], mxgemm.MXFP8Linear) and type(net.lm_head) is nn.Linear
    assert "replaced 4 of 6 linear layers" in str(report) and "skipped odd" in str(report)
    with torch.no_grad():
        assert sqnr_db(net(ids), ref) > 25  # fp32 model: layers run in bf16 and answer in fp32


def test_skip_patterns_and_second_pass():
    net = _Net()
    report = mxgemm.quantize_model(net, backend="emulation", skip=("layers.1.*", "lm_head"))
    assert [r.name for r in report.replaced] == ["layers.0.q", "layers.0.o"]
    again = mxgemm.quantize_model(net, backend="emulation", skip=())
    assert {r.name for r in again.replaced} == {"layers.1.q", "layers.1.o", "lm_head"}  # quantized ones stay


def test_hf_llama_compiles_fullgraph_and_matches_eager():
    transformers = __import__("pytest").importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    assert len(mxgemm.quantize_model(model, backend="emulation").replaced) == 14
    body = model.model
    compiled = torch.compile(
        lambda x: body(inputs_embeds=x, use_cache=False).last_hidden_state, fullgraph=True, backend="aot_eager"
    )
    with torch.no_grad():
        x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), body(inputs_embeds=x, use_cache=False).last_hidden_state)


def test_a_model_left_on_the_emulation_by_auto_says_so(caplog, monkeypatch):
    """On a machine where auto finds nothing faster, quantize_model warns in one line that the model now runs on the
    slow reference; a backend named on purpose is not warned about."""
    import logging

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a plain CPU machine: no Triton kernels

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with caplog.at_level(logging.WARNING, logger="mxgemm"):
        mxgemm.quantize_model(model, skip=())
    assert "every quantized layer runs on the emulation backend" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mxgemm"):
        mxgemm.quantize_model(nn.Sequential(nn.Linear(64, 64)), backend="emulation", skip=())
    assert "emulation backend" not in caplog.text


def test_a_request_that_cannot_run_fails_before_the_model_changes():
    """A named backend that cannot run here, an unknown recipe or scale mode: raised before the first layer is
    replaced, so the model is as it was."""
    from helpers import skip_unless_backend_runs

    skip_unless_backend_runs("triton")  # runs the first layer here, and not the second, which is on meta
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64, device="meta"))
    for kwargs, error in (
        ({"backend": "triton"}, mxgemm.BackendUnavailableError),
        ({"backend": "emulation", "recipe": "w4a4"}, ValueError),
        ({"backend": "emulation", "scale_mode": "round"}, ValueError),
    ):
        with pytest.raises(error):
            mxgemm.quantize_model(model, skip=(), **kwargs)
        assert all(type(m) is nn.Linear for m in model), kwargs


@pytest.mark.parametrize(
    "skip, layer", [(("lm_head",), "model.layers.0.self_attn.q_proj"), (("*_proj", "lm_head"), "experts")]
)
def test_weights_on_the_meta_device_are_refused_before_the_model_changes(skip, layer):
    """Layers accelerate offloaded (or never loaded) hold no data on the meta device: quantizing them would leave
    weights of nothing, so the request is refused, naming the first such layer (linear or experts), and the model
    stays as it was."""
    accelerate = pytest.importorskip("accelerate")
    from helpers import tiny_qwen3_moe

    with accelerate.init_empty_weights():
        model = tiny_qwen3_moe(layers=1)
    with pytest.raises(ValueError, match=f"{layer}.* has its weights on the meta device .*`mxgemm quantize`"):
        mxgemm.quantize_model(model, skip=skip)
    assert not any(type(m).__name__.startswith("MXFP8") for m in model.modules())


def _fail_at_the_third_layer(monkeypatch):
    """MXFP8Linear.from_linear running out of GPU memory at its third call; returns the real one."""
    real, calls = mxgemm.MXFP8Linear.from_linear, []

    def from_linear(module, **kwargs):
        calls.append(module)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(module, **kwargs)

    monkeypatch.setattr(mxgemm.MXFP8Linear, "from_linear", from_linear)
    return real


def test_a_failure_partway_says_where_it_stopped_and_that_the_model_is_partly_converted(monkeypatch, caplog):
    """A failure after the request was checked (the GPU out of memory, a kernel's error) cannot be undone: the layers
    before it freed their full-precision weights. The error keeps its type and says where it stopped and how many
    layers are already quantized (a note on it, and a line on the mxgemm logger)."""
    import logging

    _fail_at_the_third_layer(monkeypatch)
    model = _Net()
    with caplog.at_level(logging.ERROR, logger="mxgemm"), pytest.raises(torch.OutOfMemoryError) as raised:
        mxgemm.quantize_model(model, backend="emulation")
    said = "quantize_model stopped at layers.1.q: the 2 layers before it are already quantized"
    assert said in caplog.text and "CUDA out of memory" in caplog.text
    assert any(said in note for note in getattr(raised.value, "__notes__", [said]))
    kinds = [type(m).__name__ for m in (model.layers[0]["q"], model.layers[0]["o"], model.layers[1]["q"])]
    assert kinds == ["MXFP8Linear", "MXFP8Linear", "Linear"]


def test_an_atomic_quantization_that_fails_partway_leaves_the_model_as_it_was(monkeypatch, caplog):
    """``atomic=True``: every replacement is built before the first goes in, so a failure at the third layer leaves
    every layer the nn.Linear it was, its weight untouched, and says nothing of a partly converted model; without a
    failure it gives the model the default does."""
    import copy
    import logging

    model = _Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model)
    real = _fail_at_the_third_layer(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="mxgemm"), pytest.raises(torch.OutOfMemoryError):
        mxgemm.quantize_model(model, backend="emulation", atomic=True)
    assert "partly converted" not in caplog.text
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, (nn.Linear, mxgemm.MXFP8Linear)))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    monkeypatch.setattr(mxgemm.MXFP8Linear, "from_linear", real)
    mxgemm.quantize_model(model, backend="emulation", atomic=True)
    mxgemm.quantize_model(reference, backend="emulation")
    ids = torch.randint(0, 100, (2, 5))
    assert torch.equal(model(ids), reference(ids))
