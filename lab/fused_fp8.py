"""The fused FP8 kernel (bf16 activations quantized in shared memory, one launch) against quantizer + GEMM (two
launches, the GEMM a programmatic dependent), with the default config of each M: bits compared, then eager per-call
time (back to back over L2-cold weight copies, one synchronize) and device time under CUDA-graph replay, on the 8B and
Qwen2.5-7B projections.

Run on the device: PYTHONPATH=src python3 lab/fused_fp8.py --json fused-fp8.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import mxgemm
from mxgemm.backends.hybrid_sm90 import fp8_default
from mxgemm.bench import environment
from mxgemm.kernels import fp8_gemm
from mxgemm.timing import copies_for_cold_l2, time_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from eager_calls import PROJECTIONS, per_call_us


def rows_for(model, proj, n, k, has_bias, ms, sms, l2, calls, repeats) -> list[dict]:
    count = copies_for_cold_l2(n * k, l2)
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = []
    for _ in range(count):
        t = mxgemm.quantize(torch.randn(n, k, device="cuda", generator=g).mul_(0.02).bfloat16())
        weights.append(mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90"))
    bias = torch.randn(n, device="cuda", generator=g).bfloat16() if has_bias else None
    out = []
    for m in ms:
        xs = [torch.randn(m, k, device="cuda", generator=g).bfloat16() for _ in range(4)]
        qd0 = weights[0].tensors["qdata"]
        cfg = fp8_default(m, *qd0.shape, sms)
        plans = {
            mode: [
                fp8_gemm.linear_plan(w.tensors["qdata"], w.tensors["block_scale"], n, k, m, cfg, mode) for w in weights
            ]
            for mode in (False, True)
        }
        same = all(torch.equal(plans[False][0](x, bias), plans[True][0](x, bias)) for x in xs)
        row = {"model": model, "proj": proj, "n": n, "k": k, "m": m, "config": str(cfg), "bits_equal": same}
        for mode, name in ((False, "two"), (True, "fused")):
            ps = plans[mode]
            row[f"{name}_eager_us"] = per_call_us(lambda i, x, ps=ps: ps[i % count](x, bias), xs, calls, repeats)
            graph_calls = [lambda p=p, x=xs[i % 4]: p(x, bias) for i, p in enumerate(ps)]
            row[f"{name}_graph_us"] = time_cuda(graph_calls)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 17, 24, 32])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = mxgemm.describe_device()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    with torch.inference_mode():
        for p in PROJECTIONS:
            rows += rows_for(*p, args.m, sms, device.l2_bytes, args.calls, args.repeats)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": environment(device), "rows": rows}, f, indent=1)
    print("| model | proj | M | bits equal | eager two / fused µs | graph two / fused µs |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['proj']} | {r['m']} | {r['bits_equal']} | {r['two_eager_us']:.1f} / "
              f"{r['fused_eager_us']:.1f} | {r['two_graph_us']:.1f} / {r['fused_graph_us']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
