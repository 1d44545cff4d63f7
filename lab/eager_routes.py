"""How an eager FP8 call (M = 24-64) is best launched: the quantizer and the GEMM as one CUDA graph of the plan's
(what eager calls run now) or the two launched directly (a fused kernel, timed here too, is gone: history has it);
each route's eager per-call time
(``bench/eager_calls.py``'s measure, weights L2-cold) beside its device time replayed from a CUDA graph, against bf16
``F.linear``. Where an eager call waits for the GPU, the device time of the route it runs, and any gap the GPU leaves
between launches, set its time.

    PYTHONPATH=src python3 lab/eager_routes.py --json eager-routes.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.backends import get_backend
from mxgemm.kernels import fp8_gemm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bias_cost import replay_us
from eager_calls import cold_layers, per_call_us

SHAPES = [("qwen qkv +bias", 4608, 3584, True), ("qwen o", 3584, 3584, False), ("llama qkv", 6144, 4096, False),
          ("llama o", 4096, 4096, False)]  # fmt: skip
ROUTES = {"graph of two": True, "two launches": False}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[24, 32, 64])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = mxgemm.describe_device()
    backend = get_backend("hybrid_sm90")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.inference_mode():
        for name, n, k, has_bias in SHAPES:
            dense, bias, layers = cold_layers(n, k, has_bias, device.l2_bytes, g)
            count = len(dense)
            prepared = [layer.prepared for layer in layers]
            for m in args.m:
                xs = [torch.randn(m, 1, k, device="cuda", generator=g).bfloat16() for _ in range(4)]
                config = backend.choose(m, prepared[0]).config
                row = {"shape": name, "n": n, "k": k, "m": m, "config": str(config)}
                contenders = {"bf16": lambda i, x, d=dense, c=count, b=bias: F.linear(x, d[i % c], b)}
                for route, graphed in ROUTES.items():
                    plans = [fp8_gemm.linear_plan(p.tensors["qdata"], p.tensors["block_scale"], n, k, m, config,
                                                  graphed) for p in prepared]  # fmt: skip
                    contenders[route] = lambda i, x, ps=plans, c=count, b=bias: ps[i % c](x, b)
                for who, fn in contenders.items():
                    row[f"{who} eager"] = per_call_us(fn, xs, args.calls, 5)
                    row[f"{who} graph"] = replay_us(fn, xs, args.calls)
                rows.append(row)
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    names = ["bf16", *ROUTES]
    print("\nµs a call: eager / replayed from a CUDA graph")
    print("| shape | M | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for r in rows:
        cells = [f"{r[f'{w} eager']:.1f} / {r[f'{w} graph']:.1f}" if f"{w} eager" in r else "-" for w in names]
        print(f"| {r['shape']} | {r['m']} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
