"""Eager calls from M = 128 to 2048 (prefill), where hybrid_sm90 runs the CUDA quantizer and cuBLASLt as one planned
ctypes call: the host time an eager call takes to enqueue (the GPU held busy meanwhile, so nothing waits on it), its
throughput back to back, and the device time of the same call replayed in a CUDA graph, against bf16's ``F.linear``;
the plan's launcher alone beside the module call; a torch.profiler table of the launcher's host side.

Run on the device: PYTHONPATH=src python3 lab/large_m_calls.py --json large-m-calls.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from launch_cost import graph_of  # beside this script
from torch.profiler import ProfilerActivity, profile

import mxgemm
from mxgemm.bench import environment

SHAPES = {"q": (4096, 4096), "k": (1024, 4096), "gate": (14336, 4096), "down": (4096, 14336)}


def enqueue_us(fn, calls: int = 50) -> float:
    """Host time per call with the GPU busy (a sleep kernel ahead of the calls), best of 5 rounds."""
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: the calls below queue behind it
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def throughput_us(fn, calls: int = 50) -> float:
    """Per call, back to back, between CUDA events (the larger of host and device time), best of 5 rounds."""
    fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / calls * 1e3)
    return best


def replay_us(fn, calls: int = 20) -> float:
    """Device time per call: ``calls`` calls captured in one CUDA graph, replayed."""
    graph = graph_of(lambda: [fn() for _ in range(calls)])
    return throughput_us(graph.replay, calls=3) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    with torch.inference_mode():
        for name, (n, k) in SHAPES.items():
            linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            layer = mxgemm.MXFP8Linear.from_linear(linear, backend="hybrid_sm90")
            for m in (128, 256, 512, 2048):
                x = torch.randn(1, m, k, device="cuda", dtype=torch.bfloat16)
                layer(x)
                plan = next(p for key, p in layer._prepared.plans.launch.items() if key[0] == m)
                x2 = x.view(m, k)
                calls = {
                    "bf16 F.linear": lambda x=x, w=linear.weight: F.linear(x, w),
                    "mxgemm module": lambda x=x, layer=layer: layer(x),
                    "mxgemm plan": lambda x2=x2, plan=plan: plan(x2, None),
                }
                row = {"shape": name, "n": n, "k": k, "m": m}
                for who, fn in calls.items():
                    row[who] = {"enqueue_us": enqueue_us(fn), "throughput_us": throughput_us(fn),
                                "replay_us": replay_us(fn)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            if name == "k":
                x2 = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
                layer(x2)
                plan = next(p for key, p in layer._prepared.plans.launch.items() if key[0] == 2048)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        plan(x2, None)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=6), flush=True)
    print("\n| shape | M | bf16 enqueue / thr / replay | module enqueue / thr / replay | plan enqueue / thr / replay |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [" / ".join(f"{r[w][f]:.1f}" for f in ("enqueue_us", "throughput_us", "replay_us"))
                 for w in ("bf16 F.linear", "mxgemm module", "mxgemm plan")]  # fmt: skip
        print(f"| {r['shape']} {r['n']}x{r['k']} | {r['m']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(mxgemm.describe_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
