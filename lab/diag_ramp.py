"""Diagnosis (docs/performance.md): the time of each graph replay (2 ms each) from an idle start, for the FP8
path and bf16 cuBLAS on the 70B gate_up at M = 1: does the speed ramp up, and over how long?"""

import subprocess
import time
from functools import partial

import torch
import torch.nn.functional as F
from diag_settle import graph_of

import mxgemm
from mxgemm.bench import mx_weights


def trace(name, g, per_replay_calls, n=80):
    time.sleep(1.0)  # idle
    clk0 = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        g.replay()
        ev[i + 1].record()
    torch.cuda.synchronize()
    us = [ev[i].elapsed_time(ev[i + 1]) * 1e3 / per_replay_calls for i in range(n)]
    clk1 = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    print(f"{name}: idle clocks [{clk0}] after [{clk1}]")
    print("  us per call, replay by replay:", " ".join(f"{u:.0f}" for u in us))


n, k = 57344, 8192
mx = mx_weights(n, k, "cuda", 2)
ws = [mxgemm.prepare_weight(q, s) for q, s in mx]
bf = [mxgemm.dequantize(mxgemm.MXTensor(q, s), torch.bfloat16) for q, s in mx]
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
g_fp8 = graph_of([partial(mxgemm.linear, x, w) for w in ws], 8)
g_bf16 = graph_of([partial(F.linear, x, w) for w in bf], 4)
trace("fp8 path", g_fp8, 16)
trace("bf16", g_bf16, 8)

# the same calls captured anew six times (new graph memory each): one speed, or one per capture?
for i in range(6):
    g = graph_of([partial(mxgemm.linear, x, w) for w in ws], 8)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(11)]
    ev[0].record()
    for j in range(10):
        g.replay()
        ev[j + 1].record()
    torch.cuda.synchronize()
    us = sorted(ev[j].elapsed_time(ev[j + 1]) * 1e3 / 16 for j in range(10))
    print(f"capture {i}: median {us[5]:.1f} us per call")
    del g
