"""Host time of an eager MXFP8Linear call's Python, without its kernels: the layer's plan for M = 4 replaced by one
that returns a ready tensor, then the module call, ``forward``, ``mxgemm.linear``, ``run_planned`` and the plan each
timed alone (µs a call, 20000 calls after 1000). CPU emulation weights: the Python is the same on every backend.

Run: PYTHONPATH=src python3 lab/layer_overhead.py
"""

from __future__ import annotations

import time

import torch
from torch import nn

import mxgemm
from mxgemm.ops import run_planned


def per_call_us(fn, calls: int = 20000) -> float:
    for _ in range(1000):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    torch.manual_seed(0)
    layer = mxgemm.MXFP8Linear.from_linear(nn.Linear(256, 256, bias=False).to(torch.bfloat16))
    x = torch.randn(4, 1, 256, dtype=torch.bfloat16)
    out = torch.empty(4, 1, 256, dtype=torch.bfloat16)
    w = layer.prepared
    with torch.inference_mode():
        layer(x)
        key = next(iter(w.plans.launch))
        w.plans.launch[key] = lambda x, bias: out
        times = {
            "module call": per_call_us(lambda: layer(x)),
            "forward": per_call_us(lambda: layer.forward(x)),
            "linear()": per_call_us(lambda: mxgemm.linear(x, w, None)),
            "run_planned": per_call_us(lambda: run_planned(x, w, None)),
            "plan": per_call_us(lambda: w.plans.launch[key](x, None)),
        }
    print(", ".join(f"{k} {v:.2f} µs" for k, v in times.items()))


if __name__ == "__main__":
    main()
