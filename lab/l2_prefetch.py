"""The small-M kernel prefetching the next projection's weight into L2 as it ends, in a decode step's chain: a CUDA
graph of ``--layers`` Llama-3-8B layers at M tokens, each layer's four projections (qkv, o, gate_up, down) with what
a step runs between them (rotary-like elementwise work and attention over a 640-token cache before o, an add and
RMSNorm before gate_up and before the next qkv, SiLU-and-multiply before down), replayed. Variants: no prefetch, and
each projection prefetching the first ``cap`` bytes of the next one's weight. Outputs must have the same bits; times of
the variants alternate.

    PYTHONPATH=src python3 lab/l2_prefetch.py --json l2-prefetch.json

It runs with the kernel and plan of commit ba2d2cd (branch ``l2-prefetch``: ``small_m.linear_plan(prefetch=...)``, a
``cp.async.bulk.prefetch.L2`` of each CTA's share as it ends), not kept: `l2-prefetch-h200.json` has the step slower
by 0.8-1.0 µs a layer at 8 MB and 6.5-8.3 at 32 MB (M = 1, 16), growing with the bytes prefetched.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from pdl_chain import SHAPES, alternating_us, weights  # beside this script

from mxgemm.backends.hybrid_sm90 import small_m_default
from mxgemm.kernels import small_m

ORDER = list(SHAPES)
MB = 1 << 20


def plans(layers: list[dict], m: int, cap: int | None) -> list[dict]:
    """Each projection's plan, prefetching the first ``cap`` bytes (None: none) of the next one's weight."""
    flat = [(i, name) for i in range(len(layers)) for name in ORDER]
    out = [{} for _ in layers]
    for j, (i, name) in enumerate(flat):
        n, k = SHAPES[name]
        w, s = layers[i][name]
        nxt = None
        if cap is not None and j + 1 < len(flat):
            wn = layers[flat[j + 1][0]][flat[j + 1][1]][0].view(-1)
            nxt = wn[: min(cap, wn.numel())]
        out[i][name] = small_m.linear_plan(w, s, n, k, m, small_m_default(n, k), graphed=False, prefetch=nxt)
    return out


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)


def step(layer_plans: list[dict], x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    outs, h = [], x
    kc, vc = cache
    m = x.shape[0]
    for p in layer_plans:
        qkv = p["qkv"](rms(h), None)
        q = (qkv[:, :4096] * 1.0001).view(m, 32, 1, 128)
        kc[:m, :, -1:] = qkv[:, 4096:5120].view(m, 8, 1, 128)
        vc[:m, :, -1:] = qkv[:, 5120:].view(m, 8, 1, 128)
        a = F.scaled_dot_product_attention(q, kc[:m], vc[:m], enable_gqa=True).reshape(m, 4096)
        o = p["o"](a, None)
        h = h + o
        gu = p["gate_up"](rms(h), None)
        down = p["down"](F.silu(gu[:, :14336]) * gu[:, 14336:], None)
        h = h + down
        outs += [qkv, o, gu, down]
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--caps-mb", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = weights(args.layers, g)
    variants = {"off": None, **{f"{c}MB": c * MB for c in args.caps_mb}}
    rows = []
    for m in args.m:
        x = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda", generator=g) * 0.1
        cache = tuple(torch.randn(16, 8, 640, 128, dtype=torch.bfloat16, device="cuda", generator=g) for _ in "kv")
        graphs, outs = {}, {}
        for who, cap in variants.items():
            ps = plans(layers, m, cap)
            for _ in range(2):
                step(ps, x, cache)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs[who] = step(ps, x, cache)
            graphs[who] = (graph, ps)
        for graph, _ in graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        times = alternating_us({who: graph.replay for who, (graph, _) in graphs.items()}, args.rounds)
        base = statistics.median(times["off"])
        for who, t in times.items():
            same = all(torch.equal(a, b) for a, b in zip(outs["off"], outs[who], strict=True))
            row = {"m": m, "variant": who, "us": statistics.median(t), "spread": [min(t), max(t)], "same_bits": same}
            row["gain_us_per_layer"] = (base - row["us"]) / args.layers
            rows.append(row)
            print(json.dumps(row), flush=True)
        del graphs
    gpu = torch.cuda.get_device_name()
    print(f"\n{args.layers} layers a step, medians of {args.rounds} rounds of 5 replays ({gpu})")
    print("| M | prefetch of the next weight | step µs | gain µs a layer | same bits |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['m']} | {r['variant']} | {r['us']:.0f} | {r['gain_us_per_layer']:.2f} | {r['same_bits']} |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
