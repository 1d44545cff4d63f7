"""Host time of an MXFP8Experts call at prefill and decode sizes, and of each step inside it: the module's forward, the
functional call, the op, its implementation, the backend's plan of the call (where gate/up's tactic is the wgmma
kernel, the whole block in one C call), the same launches one by one, the tactic lookups, and each launch of the
wgmma path (the sort, the gathered quantization, gate/up, the gated quantization, down, the weighted sum), each called
back to back and timed until the last call returns (before synchronising). Qwen3-30B-A3B's experts (128, hidden 2048,
width 768, top-8).

Run on the device: PYTHONPATH=src python3 lab/moe_experts_host.py [--tokens 2048 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import mxgemm
from mxgemm import autotune
from mxgemm.backends import get_backend
from mxgemm.kernels.grouped.quant import quantize_rows
from mxgemm.kernels.grouped.routing import combine, sort_by_expert
from mxgemm.kernels.grouped.wgmma import WgmmaConfig, grouped_wgmma
from mxgemm.ops import _moe_experts, moe_experts_op


def host_us(fn, n: int = 20, rounds: int = 5) -> float:
    """Median over ``rounds`` of µs of host time a call, ``n`` calls back to back before one synchronisation."""
    out = []
    fn()
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


class Experts(torch.nn.Module):  # the attributes MXFP8Experts.from_experts reads
    def __init__(self, e: int, h: int, i: int):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * i, h, dtype=torch.bfloat16) * 0.02)
        self.down_proj = torch.nn.Parameter(torch.randn(e, h, i, dtype=torch.bfloat16) * 0.02)
        self.act_fn = torch.nn.SiLU()


def steps(experts: mxgemm.MXFP8Experts, tokens: int, topk: int) -> dict[str, float]:
    e, h = experts.num_experts, experts.gate_up.in_features
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    w, ids = torch.randn(tokens, e, device="cuda").softmax(-1).topk(topk, -1)
    w = w.to(torch.bfloat16)
    gu, dn, b = experts.gate_up, experts.down, get_backend(experts.backend)
    rows = ids.numel()
    tactics = tuple(autotune.tactic_for_grouped_call(b, wt, rows, x) for wt in (gu, dn))
    plan = b.plan_experts(gu, dn, tokens, topk, x.dtype, tactics)
    print(f"T = {tokens}: the op's plan is {type(plan).__name__}")
    op_args = (x, ids, w, gu.op_tensors, dn.op_tensors, gu.backend, gu.op_meta, dn.op_meta)
    offsets, src = sort_by_expert(ids, e)
    xq, xs = quantize_rows(x, src, topk)
    gq, gs = gu.tensors["qdata"].view(torch.uint8), gu.tensors["block_scale"]
    dq, ds = dn.tensors["qdata"].view(torch.uint8), dn.tensors["block_scale"]
    # the steps of the wgmma path, with the tuned configs where they are the wgmma kernel's (host time only)
    first, second = (c if isinstance(c := getattr(t, "config", None), WgmmaConfig) else WgmmaConfig() for t in tactics)
    hidden = grouped_wgmma(xq, xs, rows, gq, gs, offsets, gu.out_features, x.dtype, first)
    pq, ps = quantize_rows(hidden, gated=True)
    y = grouped_wgmma(pq, ps, rows, dq, ds, offsets, dn.out_features, x.dtype, second, dst=src)
    out = {
        "forward": host_us(lambda: experts(x, ids, w)),
        "moe_experts": host_us(lambda: mxgemm.moe_experts(x, ids, w, gu, dn)),
        "moe_experts_op": host_us(lambda: moe_experts_op(*op_args)),
        "_moe_experts (the op's body)": host_us(lambda: _moe_experts(*op_args)),
        "the op's plan": host_us(lambda: plan(x, ids, w, gu, dn)),
        "run_experts (launch by launch)": host_us(lambda: b.run_experts(x, ids, w, gu, dn, tactics)),
        "two tactic lookups": host_us(lambda: [autotune.tactic_for_grouped_call(b, wt, rows, x) for wt in (gu, dn)]),
        "sort_by_expert": host_us(lambda: sort_by_expert(ids, e)),
        "quantize_rows, gathered": host_us(lambda: quantize_rows(x, src, topk)),
        "grouped_wgmma gate/up": host_us(
            lambda: grouped_wgmma(xq, xs, rows, gq, gs, offsets, gu.out_features, x.dtype, first)
        ),
        "quantize_rows, gated": host_us(lambda: quantize_rows(hidden, gated=True)),
        "grouped_wgmma down": host_us(
            lambda: grouped_wgmma(pq, ps, rows, dq, ds, offsets, dn.out_features, x.dtype, second, dst=src)
        ),
        "combine": host_us(lambda: combine(y, w)),
        "torch.empty": host_us(lambda: torch.empty(rows, 1536, device="cuda", dtype=torch.bfloat16)),
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 16])
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    with torch.device("cuda"):
        experts = mxgemm.MXFP8Experts.from_experts(Experts(128, 2048, 768))
    print(experts)
    table = {}
    with torch.inference_mode():
        for tokens in args.tokens:
            table[tokens] = steps(experts, tokens, 8)
    print(f"{'µs of host time a call':32s}" + "".join(f"{f'T = {t}':>10s}" for t in table))
    for name in table[args.tokens[0]]:
        print(f"{name:32s}" + "".join(f"{table[t][name]:10.1f}" for t in table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
