"""What a bias costs an eager call, and whether the host or the GPU sets that call's time: Qwen2.5-7B's qkv (4608 x
3584, which has a bias) and o (3584 x 3584) as ``MXFP8Linear`` layers with and without a bias, their eager per-call
time (``bench/eager_calls.py``'s measure) beside the device time of the same calls replayed from a CUDA graph, and bf16
``F.linear`` likewise.

    PYTHONPATH=src python3 lab/bias_cost.py --json bias-cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.timing import copies_for_cold_l2

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from eager_calls import per_call_us


def replay_us(fn, inputs, calls: int) -> float:
    """Device time a call: ``calls`` calls captured in one CUDA graph, replayed, the median of 5 replays."""
    for x in inputs[:3]:
        fn(0, x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i, inputs[i % len(inputs)])
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 24, 32, 64])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = mxgemm.describe_device()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        for proj, n, k in (("qkv", 4608, 3584), ("o", 3584, 3584)):
            count = copies_for_cold_l2(n * k * 2, device.l2_bytes)
            dense = [torch.randn(n, k, device="cuda", generator=g).mul_(0.02).bfloat16() for _ in range(count)]
            bias = torch.randn(n, device="cuda", generator=g).bfloat16()
            quantized = [mxgemm.quantize(w) for w in dense]
            for b in (bias, None):
                layers = [mxgemm.MXFP8Linear.from_quantized(t.qdata, t.scale, b) for t in quantized]
                contenders = {
                    "bf16": lambda i, x, b=b, d=dense, c=count: F.linear(x, d[i % c], b),
                    "mxgemm": lambda i, x, ls=layers, c=count: ls[i % c](x),
                }
                for m in args.m:
                    xs = [torch.randn(m, 1, k, device="cuda", generator=g).bfloat16() for _ in range(4)]
                    row = {"proj": proj, "n": n, "k": k, "bias": b is not None, "m": m}
                    for name, fn in contenders.items():
                        row[f"{name}_eager_us"] = per_call_us(fn, xs, args.calls, 5)
                        row[f"{name}_graph_us"] = replay_us(fn, xs, args.calls)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    print("\n| proj | bias | M | bf16 eager | bf16 graph | mxgemm eager | mxgemm graph |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['proj']} | {r['bias']} | {r['m']} | {r['bf16_eager_us']:.1f} | {r['bf16_graph_us']:.1f} | "
              f"{r['mxgemm_eager_us']:.1f} | {r['mxgemm_graph_us']:.1f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
