"""Host time of an eager decode step's parts in a Qwen3-MoE of Qwen3-30B-A3B dimensions, bf16 (transformers'
``grouped_mm`` experts) against mxgemm, at one token: each part called back to back (the host's rate, the GPU far
from busy) and one by one with a synchronisation (latency): the sparse MoE block (router and experts), the experts
alone, the attention, a decoder layer, and a whole one-token step of a few layers with a warm KV cache.

Run on the device: PYTHONPATH=src python3 lab/moe_layer_host.py [--layers 4] [--tokens 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build, config

DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def rate(fn, n: int = 200) -> float:
    """µs a call, ``n`` calls back to back, one synchronisation at the end (median of 5 rounds)."""
    out = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def parts(model, tokens: int) -> dict[str, float]:
    layer = model.model.layers[0]
    h = model.config.hidden_size
    x = torch.randn(1, tokens, h, device=DEVICE, dtype=torch.bfloat16)
    flat = x.view(-1, h)
    mlp = layer.mlp
    _, w, idx = mlp.gate(flat)  # transformers 5's router: (logits, weights, indices)
    ids = torch.arange(tokens, device=DEVICE)[None]
    pos = model.model.rotary_emb(x, ids)
    out = {
        "moe block": rate(lambda: mlp(x)),
        "router": rate(lambda: mlp.gate(flat)),
        "experts": rate(lambda: mlp.experts(flat, idx, w)),
        "attention": rate(lambda: layer.self_attn(layer.input_layernorm(x), pos, None)[0]),
        "decoder layer": rate(lambda: layer(x, attention_mask=None, position_ids=ids, position_embeddings=pos)),
    }
    return out


def step_times(model, n: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, 64), device=DEVICE)
    out = model(ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times[n // 2 :])


def generate_ms(model, new: int, batch: int = 1) -> float:
    """ms a new token of ``generate`` (greedy, 64-token prompt), the median of 3 calls."""
    ids = torch.randint(0, model.config.vocab_size, (batch, 64), device=DEVICE)
    times = []
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        sync()
        times.append((time.perf_counter() - t0) * 1e3 / new)
    return statistics.median(times)


def profiled(model, new: int) -> str:
    """cProfile of one ``generate`` call, by cumulative time."""
    import cProfile
    import io
    import pstats

    ids = torch.randint(0, model.config.vocab_size, (1, 64), device=DEVICE)
    profile = cProfile.Profile()
    profile.enable()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    sync()
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(45)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="cProfile a generate call of each model")
    parser.add_argument("--tiny", action="store_true", help="a few-MB model on the CPU: a smoke test of this script")
    args = parser.parse_args()
    global DEVICE
    DEVICE = "cpu" if args.tiny else "cuda"
    cfg = config(args.layers, tiny=args.tiny, moe=True)
    models = {who: build(cfg, who, (), device=DEVICE)[0] for who in ("bf16", "mxgemm")}
    rows = {}
    with torch.no_grad():
        for model in models.values():  # warm: kernels built, plans made, cuDNN's attention planned
            parts(model, args.tokens)
            step_times(model, 40)
        for who, model in models.items():
            rows[who] = parts(model, args.tokens)
            rows[who][f"step ({args.layers} layers), ms"] = step_times(model, 60)
            rows[who]["generate, ms a token"] = generate_ms(model, 32)
    print(f"{'part (µs a call, back to back)':36s} {'bf16':>10s} {'mxgemm':>10s}")
    for name in rows["bf16"]:
        print(f"{name:36s} {rows['bf16'][name]:10.1f} {rows['mxgemm'][name]:10.1f}")
    print(models["mxgemm"].model.layers[0].mlp.experts)
    if args.profile:
        for who, model in models.items():
            print(f"== {who}: generate, 32 new tokens\n" + profiled(model, 32)[:9000])


if __name__ == "__main__":
    main()
