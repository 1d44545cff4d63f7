"""Diagnosis (docs/performance.md): `lab/diag_offsets.py` found the FP8 GEMM slow (~7%) only in the first
timing after its weights were made, at every activation address. What starts the slow spell, and how long does it
last? After each event below, the 70B gate_up at M = 1 (the FP8 path, and bf16 cuBLAS) is replayed back to back for
0.4 s as a CUDA graph; the mean µs per call in each 20 ms window is printed.

Run on the device: PYTHONPATH=src python3 lab/diag_settle.py
"""

import time
from functools import partial

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.bench import mx_weights
from mxgemm.timing import time_cuda

N, K = 57344, 8192


def graph_of(calls, rounds):
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for _ in range(rounds):
            for f in calls:
                f()
    return g


def trace(name, g, calls_per_replay, seconds=1.2, window=0.1):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    stamps = []
    while time.perf_counter() - t0 < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        stamps.append((time.perf_counter() - t0, a, b))
        if len(stamps) % 4 == 0:
            torch.cuda.synchronize()  # keep the host's clock close to the GPU's
    torch.cuda.synchronize()
    cells = []
    for w in range(int(seconds / window)):
        inside = [(a, b) for t, a, b in stamps if w * window <= t < (w + 1) * window]
        us = sorted(a.elapsed_time(b) * 1e3 / calls_per_replay for a, b in inside)
        cells.append(f"{sum(us) / len(us):.0f}" if us else "-")
    print(f"{time.strftime('%T', time.localtime(time.time() - seconds))} {name:>34}: " + " ".join(cells), flush=True)


def main() -> None:
    mx = mx_weights(N, K, "cuda", 2)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    bf = [mxgemm.dequantize(mxgemm.MXTensor(q, s), torch.bfloat16) for q, s in mx]
    g_bf = graph_of([partial(F.linear, x, w) for w in bf], 4)
    fine = partial(trace, seconds=0.4, window=0.02)
    print(f"mean µs per call, 20 ms windows over 0.4 s of back-to-back replays; {N}x{K} M=1", flush=True)
    ws = [mxgemm.prepare_weight(q, s) for q, s in mx]
    g = graph_of([partial(mxgemm.linear, x, w) for w in ws], 8)
    fine("fp8, fresh weights", g, 16)
    fine("fp8, again", g, 16)
    fine("bf16", g_bf, 8)
    ws2 = [mxgemm.prepare_weight(q, s) for q, s in mx]
    torch.cuda.synchronize()
    fine("bf16, at once after a prepare", g_bf, 8)
    fine("fp8 old weights, then", g, 16)
    g2 = graph_of([partial(mxgemm.linear, x, w) for w in ws2], 8)
    fine("fp8 on the new weights", g2, 16)
    fine("fp8 on the new weights, again", g2, 16)
    del g2, ws2
    torch.cuda.empty_cache()
    ws3 = [mxgemm.prepare_weight(q, s) for q, s in mx]  # new segments from the driver
    torch.cuda.synchronize()
    fine("bf16, after a prepare in new memory", g_bf, 8)
    g3 = graph_of([partial(mxgemm.linear, x, w) for w in ws3], 8)
    fine("fp8 on them", g3, 16)
    fine("fp8 on them, again", g3, 16)
    for _ in range(3):
        one = time_cuda([partial(mxgemm.linear, x, w) for w in ws3])
        two = time_cuda([partial(F.linear, x, w) for w in bf])
        print(f"time_cuda: fp8 {one:.1f} bf16 {two:.1f}", flush=True)
    del g3, ws3
    torch.cuda.empty_cache()
    big = torch.ones(8 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    fine("fp8 old, after 8 GiB new + written", g, 16)
    del big
    torch.cuda.empty_cache()
    fine("fp8 old, after 8 GiB freed", g, 16)


if __name__ == "__main__":
    main()
