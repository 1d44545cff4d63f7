"""The routed block in four launches (sort, gate/up with the product, down written back in token order, weighted sum)
against the same kernels with the glue in PyTorch (``GroupedWeights.run_experts``'s default: argsort, counts, gather,
two grouped calls, SiLU and product, index_copy, the weighted sum): CUDA-graph time (8 routings per graph) and eager
time per call (back to back, one synchronisation at the end; transformers' bf16 ``grouped_mm`` experts beside them),
bit equality checked first.

    PYTHONPATH=src python3 lab/moe_glue.py --json moe-glue.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch

import mxgemm
from mxgemm.backends import get_backend
from mxgemm.backends.capabilities import GroupedWeights
from mxgemm.bench_moe import MOE_MODELS, experts_with_bf16, hf_experts, top_k_routing
from mxgemm.timing import time_cuda

TOKENS = [1, 4, 16, 64, 256, 1024, 4096]


def eager_us(fn, calls=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="*", default=list(MOE_MODELS))
    ap.add_argument("--json", default="moe-glue.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    triton_backend = get_backend("triton")
    rows = []
    for model in args.models:
        e, hidden, width, topk = MOE_MODELS[model]
        w, w16 = {}, {}
        for proj, (n, k) in (("gate_up", (2 * width, hidden)), ("down", (hidden, width))):
            q, s, w16[proj] = experts_with_bf16(e, n, k, seed=n + k, device=dev)
            w[proj] = mxgemm.prepare_grouped_weight(q, s, backend="triton")
            del q, s
        hf = hf_experts(e, hidden, width, topk, w16["gate_up"], w16["down"])
        torch.cuda.empty_cache()
        for t in TOKENS:
            picks = [top_k_routing(t, e, topk, seed=r, device=dev) for r in range(8)]
            xs = [torch.randn(t, hidden, device=dev).bfloat16() for _ in picks]
            fused = [
                partial(mxgemm.moe_experts, x, i, p, w["gate_up"], w["down"])
                for x, (i, p) in zip(xs, picks, strict=True)
            ]
            steps = [
                partial(GroupedWeights.run_experts, triton_backend, x, i, p, w["gate_up"], w["down"])
                for x, (i, p) in zip(xs, picks, strict=True)
            ]
            same = all(torch.equal(f(), s()) for f, s in zip(fused, steps, strict=True))
            row = {
                "model": model,
                "tokens": t,
                "bit_equal": same,
                "graph_fused_us": time_cuda(fused, warmup_ms=50),
                "graph_steps_us": time_cuda(steps, warmup_ms=50),
            }
            if t <= 64:
                row["eager_fused_us"] = eager_us(fused[0])
                row["eager_steps_us"] = eager_us(steps[0])
                row["eager_bf16_us"] = eager_us(partial(hf, xs[0], *picks[0]))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del w, w16, hf
        torch.cuda.empty_cache()
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(args.json, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"\n{env['device']}")
    head = "| model | tokens | equal | graph steps µs | graph fused µs | speedup | eager steps µs | eager fused µs |"
    print(head + " eager bf16 experts µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        eager = "- | - | -"
        if "eager_fused_us" in r:
            eager = " | ".join(f"{r[k]:.1f}" for k in ("eager_steps_us", "eager_fused_us", "eager_bf16_us"))
        speed = r["graph_steps_us"] / r["graph_fused_us"]
        print(
            f"| {r['model']} | {r['tokens']} | {r['bit_equal']} | {r['graph_steps_us']:.1f} | "
            f"{r['graph_fused_us']:.1f} | {speed:.2f} | {eager} |"
        )


if __name__ == "__main__":
    main()
