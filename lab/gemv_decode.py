"""The grouped GEMV on CUDA cores (``kernels/grouped/gemv.py``, offered to the tuner up to 2 rows an expert) at decode
sizes, beside the grouped Triton kernel and the read floor.

At one token the grouped kernel runs one CTA of 4 warps an SM and reads at 40% of DRAM's bandwidth
(``lab/results/decode-ncu-h100.txt``), while a kernel that only reads the active experts' bytes (``read``) runs 50
warps an SM. The GEMV has the read's shape: one sorted row and ``bn`` weight rows a program, ``kb`` 128-deep blocks
a step, fp32 sums on CUDA cores, no shared-memory ring unless ``stages`` asks Triton's pipeliner for one.

For each problem, under CUDA-graph replay of 8 routings as ``mxgemm bench --moe`` times them: the best read of
``lab/read_floor.py``'s sweep, the grouped kernel (its default decode config and 64 weight rows), and every GEMV
config, each checked against the grouped kernel (relative error; whether its bits are the same) before it is timed;
plain rows (``grouped_linear``'s form) and the routed block's forms (gathered gate/up with ``silu(gate) * up``,
scattered down).

Run on the device (``h200_pending.sh gemv`` runs this, then the GPU tests that run the GEMV):
cd lab && PYTHONPATH=../src python3 gemv_decode.py --json $OUT/gemv-decode.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import triton
from read_floor import DECODE, PROBLEMS, read_times

import mxgemm
from mxgemm.bench_moe import FP8_BYTES_PER_PARAMETER, MOE_MODELS, copy_bandwidth, random_experts, top_k_routing
from mxgemm.kernels.grouped import gemv
from mxgemm.kernels.grouped.fp8 import grouped_block_linear, grouped_down, grouped_gate_up
from mxgemm.kernels.grouped.routing import sort_by_expert
from mxgemm.timing import time_cuda

ROUTINGS = 8


def _calls(form, xs, tokens_xs, qd, bs, routed, n, topk, config):
    """One call per routing of ``form`` (plain, gated, scatter) with ``config`` (a GroupedConfig: the grouped kernel;
    a GemvConfig: the GEMV)."""
    calls = []
    for x, t, (offs, src) in zip(xs, tokens_xs, routed, strict=True):
        if form == "plain":
            calls.append(partial(grouped_block_linear, x, qd, bs, offs, n, config))
        elif form == "gated":
            calls.append(partial(grouped_gate_up, t, qd, bs, offs, src, topk, config))
        else:
            calls.append(partial(grouped_down, x, qd, bs, offs, src, n, config))
    return calls


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


GEMVS = [
    gemv.GemvConfig(bn, kb, warps, stages)
    for bn in (16, 32, 64, 128)
    for kb in (1, 2, 4, 8, 16)
    for warps in (4, 8)
    for stages in (1, 3)
]
GEMVS = [c for c in GEMVS if c.valid() and (c.bn >= 64) == (c.warps == 8)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--stages", default="1,3", help="the GEMV's stages to sweep (comma-separated)")
    args = parser.parse_args()
    stages = {int(s) for s in args.stages.split(",")}
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.3f} TB/s (read plus written)")
    out = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bandwidth, "rows": []}
    table = []
    for model, proj, token_counts in PROBLEMS:
        e, hidden, width, topk = MOE_MODELS[model]
        n, k = (2 * width, hidden) if proj == "gate_up" else (hidden, width)
        w = mxgemm.prepare_grouped_weight(*random_experts(e, n, k, seed=1, device=dev))
        qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
        words = qd.view(torch.int32).view(e, -1)
        for tokens in token_counts:
            picks = [top_k_routing(tokens, e, topk, seed=r, device=dev)[0] for r in range(ROUTINGS)]
            routed = [sort_by_expert(i, e) for i in picks]
            ids = [torch.unique(i.flatten()).int() for i in picks]
            active = sum(len(i) for i in ids) / ROUTINGS
            floor = active * n * k * FP8_BYTES_PER_PARAMETER / bandwidth * 1e6
            rows = tokens * topk
            xs = [torch.randn(rows, k, device=dev).bfloat16() for _ in picks]
            ts = [torch.randn(tokens, k, device=dev).bfloat16() for _ in picks]
            read = min(read_times(words, ids).values())
            forms = ("plain", "gated") if proj == "gate_up" else ("plain", "scatter")
            for form in forms:
                res = {
                    "model": model,
                    "proj": proj,
                    "form": form,
                    "tokens": tokens,
                    "active": active,
                    "floor_us": floor,
                    "read_us": read,
                    "grouped": {},
                    "gemv": {},
                }
                ref = _calls(form, xs, ts, qd, bs, routed, n, topk, DECODE[0])[0]()
                for c in DECODE:
                    res["grouped"][str(c)] = time_cuda(_calls(form, xs, ts, qd, bs, routed, n, topk, c), warmup_ms=20)
                for v in [c for c in GEMVS if c.stages in stages]:
                    calls = _calls(form, xs, ts, qd, bs, routed, n, topk, v)
                    try:
                        y = calls[0]()
                    except triton.runtime.errors.OutOfResources:
                        continue
                    err = _rel(y, ref)
                    if err > 1e-2:
                        print(f"   {form} {v}: rel err {err:.1e} against the grouped kernel; not timed")
                        continue
                    same = torch.equal(y, ref)
                    res["gemv"][f"{v} err={err:.1e} same={same}"] = time_cuda(calls, warmup_ms=20)
                g_best = min(res["grouped"], key=res["grouped"].get)
                v_best = min(res["gemv"], key=res["gemv"].get) if res["gemv"] else None
                print(f"== {model} {proj} {form} T={tokens} active {active:.1f} floor {floor:.1f} read {read:.1f} us")
                for name in ("grouped", "gemv"):
                    for key, us in sorted(res[name].items(), key=lambda kv: kv[1])[:6]:
                        print(f"   {name:8s} {us:8.1f}  {key}")
                table.append(
                    (
                        f"{model} {proj} {form} T={tokens}",
                        floor,
                        read,
                        res["grouped"][g_best],
                        res["gemv"][v_best] if v_best else float("nan"),
                        v_best,
                    )
                )
                out["rows"].append(res)
                if args.json:  # after each problem: a run stopped by its timeout keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(out, f, indent=1)
        del w, qd, bs, words
        torch.cuda.empty_cache()
    print(f"\n{'problem':40s} {'floor':>7s} {'read':>7s} {'grouped':>8s} {'gemv':>7s}  gemv/floor  best gemv")
    for name, floor, read, grouped, best, v_best in table:
        print(f"{name:40s} {floor:7.1f} {read:7.1f} {grouped:8.1f} {best:7.1f}  {best / floor:10.2f}  {v_best}")


if __name__ == "__main__":
    main()
