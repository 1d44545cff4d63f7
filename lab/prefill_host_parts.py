"""The host time to enqueue (GPU held busy, best of 5 rounds) of 8 decoder layers at Llama-3-8B dimensions on 2048
tokens, and of one layer's MLP, attention, and gate and up projections 8 times each, for each of mxgemm's routes above
``fusion.MAX_ROWS`` (``prefill_host.route``): a finer look than ``prefill_host.py``'s single rounds.

Run on the device: PYTHONPATH=src python3 lab/prefill_host_parts.py
"""

import sys

import torch

sys.path.insert(0, "lab")
sys.path.insert(0, "bench")
from model_e2e import build
from prefill_host import enqueue_ms, route, run_layers

from mxgemm.backends import get_backend

model = build(8, "mxgemm", ())[0]
backend = get_backend(model.model.layers[0].self_attn.q_proj.prepared.backend)
hidden = torch.randn(1, 2048, 4096, device="cuda", dtype=torch.bfloat16)
with torch.inference_mode():
    pos = model.model.rotary_emb(hidden, torch.arange(2048, device="cuda")[None])
    L = model.model.layers[0]
    h2 = L.post_attention_layernorm(hidden)
    for r in ("planned", "unshared", "scaled_mm"):
        with route(backend, r):
            run_layers(model, hidden, pos)
            L.mlp(h2)
            L.self_attn(hidden, position_embeddings=pos, attention_mask=None)
            e8 = enqueue_ms(lambda: run_layers(model, hidden, pos), rounds=5)
            mlp = enqueue_ms(lambda: [L.mlp(h2) for _ in range(8)], rounds=5)
            att = enqueue_ms(
                lambda: [L.self_attn(hidden, position_embeddings=pos, attention_mask=None) for _ in range(8)], rounds=5
            )
            gu = enqueue_ms(lambda: [(L.mlp.gate_proj(h2), L.mlp.up_proj(h2)) for _ in range(8)], rounds=5)
            print(f"{r}: 8 layers {e8:.2f} ms; 8x mlp {mlp:.2f}; 8x attn {att:.2f}; 8x gate+up {gu:.2f}", flush=True)
