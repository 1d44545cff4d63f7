"""Whether an eager call waits on the host or on the GPU: for each contender, its host time a call (the calls issued
while the GPU is held by a long sleep kernel, so that no launch waits for the GPU), its GPU time a call when the GPU
runs the calls back to back (timed from the end of the sleep, the calls all queued by then), and the eager time a
call (``bench/eager_calls.py``'s measure). An eager call costs about the larger of the first two.

Contenders: bf16 ``F.linear``; the layer (its C++ table), on activations rotating through four buffers and on one
buffer (a graphed plan sets no node then); the FP8 plan's launcher called from Python, graphed and
not; and its C entry point through ctypes with the same pointers on every call (the graph's nodes left as they are),
with the activations alternating (the quantizer's node set each call), and with the output alternating (both nodes
set); and the entry of the plan that launches the two kernels directly, the activations alternating. Weights rotated
so that they exceed 3x the L2, as in ``bench/eager_calls.py``.

    PYTHONPATH=src python3 lab/eager_split.py --json eager-split.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm import autotune
from mxgemm.backends import get_backend
from mxgemm.kernels import fp8_gemm, raw_stream

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from eager_calls import cold_layers, per_call_us

SHAPES = [("qwen qkv +bias", 4608, 3584, True), ("llama qkv", 6144, 4096, False), ("llama o", 4096, 4096, False),
          ("qwen o", 3584, 3584, False)]  # fmt: skip
SLEEP_CYCLES = 80_000_000  # ~40 ms at the H200's clock: longer than issuing the calls


def split_us(fn, inputs, calls: int, repeats: int = 5) -> tuple[float, float, float]:
    """(host µs a call, GPU µs a call back to back, ms the host took to issue all): medians over rounds."""
    for x in inputs[:3]:
        fn(0, x)
    torch.cuda.synchronize()
    hosts, gpus, issue = [], [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i, inputs[i % len(inputs)])
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        hosts.append((t1 - t0) / calls * 1e6)
        gpus.append(start.elapsed_time(end) * 1e3 / calls)
        issue.append((t1 - t0) * 1e3)
    return statistics.median(hosts), statistics.median(gpus), max(issue)


def entry_contenders(plans, xs, bias, k: int, stream: int) -> dict:
    """The plans' C entry point through ctypes: the same pointers every call; the activations alternating between
    two buffers (one node set a call); the output alternating (both nodes set)."""
    entry = plans[0].entry
    fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_void_p)(entry.fn)  # fmt: skip
    ys = [torch.empty(entry.rows, entry.cols, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    xp, yp = [x.data_ptr() for x in xs], [y.data_ptr() for y in ys]
    bp = None if bias is None else bias.data_ptr()
    pa, count = [p.entry.plan for p in plans], len(plans)
    calls = {
        "entry same": lambda i, x: fn(pa[i % count], xp[0], k, bp, yp[0], stream),
        "entry x alt": lambda i, x: fn(pa[i % count], xp[(i // count) % 2], k, bp, yp[0], stream),
        "entry y alt": lambda i, x: fn(pa[i % count], xp[0], k, bp, yp[(i // count) % 2], stream),
    }
    for call in calls.values():
        call.buffers = ys  # the outputs live as long as the calls
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 24, 32, 64])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = mxgemm.describe_device()
    backend = get_backend("hybrid_sm90")
    g = torch.Generator(device="cuda").manual_seed(0)
    stream = raw_stream(torch.cuda.current_device())
    rows = []
    with torch.inference_mode():
        for name, n, k, has_bias in SHAPES:
            dense, bias, layers = cold_layers(n, k, has_bias, device.l2_bytes, g)
            count = len(dense)
            prepared = [layer.prepared for layer in layers]
            for m in args.m:
                xs = [torch.randn(m, 1, k, device="cuda", generator=g).bfloat16() for _ in range(4)]
                tactic = autotune.tactic_for_call(backend, prepared[0], xs[0].view(m, k))
                config = backend.choose(m, prepared[0], tactic).config  # what the layer's plan runs
                row = {"shape": name, "n": n, "k": k, "m": m, "config": str(config)}
                contenders = {"bf16": lambda i, x, d=dense, c=count, b=bias: F.linear(x, d[i % c], b),
                              "layer": lambda i, x, ls=layers, c=count: ls[i % c](x),
                              "layer one x": lambda i, x, ls=layers, c=count, x0=xs[0]: ls[i % c](x0)}  # fmt: skip
                if isinstance(config, fp8_gemm.SwapAB | fp8_gemm.TokensAsM):
                    routes = {}
                    for route, graphed in (("graph py", True), ("two launches py", False)):
                        routes[route] = [fp8_gemm.linear_plan(p.tensors["qdata"], p.tensors["block_scale"], n, k, m,
                                                              config, graphed) for p in prepared]  # fmt: skip
                        contenders[route] = lambda i, x, ps=routes[route], c=count, b=bias: ps[i % c](x, b)
                    contenders.update(entry_contenders(routes["graph py"], xs, bias, k, stream))
                    direct = entry_contenders(routes["two launches py"], xs, bias, k, stream)
                    contenders["entry direct"] = direct["entry x alt"]
                for who, fn_ in contenders.items():
                    host, gpu, issue_ms = split_us(fn_, xs, args.calls)
                    row[who] = {"host": host, "gpu": gpu, "eager": per_call_us(fn_, xs, args.calls, 5),
                                "issue_ms": issue_ms}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            del layers, prepared, dense
            torch.cuda.empty_cache()
    print("\nµs a call: host / GPU back to back / eager")
    names = ["bf16", "layer", "layer one x", "graph py", "two launches py", "entry same", "entry x alt", "entry y alt",
             "entry direct"]  # fmt: skip
    print("| shape | M | config | " + " | ".join(names) + " |\n|---|---|---|" + "---|" * len(names))
    for r in rows:
        cells = [f"{r[w]['host']:.1f} / {r[w]['gpu']:.1f} / {r[w]['eager']:.1f}" if w in r else "-" for w in names]
        print(f"| {r['shape']} | {r['m']} | {r['config'][:40]} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
