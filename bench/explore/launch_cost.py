"""Host time of launching work on the device machine, to choose how an eager two-kernel call (the 1x128 quantizer
and the FP8 GEMM) should launch: as two kernel launches, or as one launch of a small CUDA graph holding both.

Per call, ``--calls`` back to back, synchronized once at the end, best of ``--repeats`` rounds: one and two CUDA
quantizer launches on 4 x 128 activations (one ctypes call each); a CUDA graph of one and of two such launches,
replayed; ``torch.empty`` of the FP8 linear's buffer; the FP8 linear of a 6144 x 4096 weight at M = 24 as two
kernels and as the fused one; bf16 ``F.linear`` on the same shape. Tiny kernels, so that host time is what is timed
(the device finishes each before the host issues the next).

Run on the device: PYTHONPATH=src python3 bench/explore/launch_cost.py --json launch-cost.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from op_overhead import per_call_us  # beside this script (its folder is on sys.path when run)

import mxgemm
from mxgemm.bench import environment
from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.fp8_gemm import SwapAB


def graph_of(fn) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    x = torch.randn(4, 128, device="cuda").bfloat16()
    quant = lambda: fp8_gemm.quantize_1x128(x)  # noqa: E731
    twice = lambda: (quant(), quant())  # noqa: E731
    one, two = graph_of(quant), graph_of(twice)

    n, k, m = 6144, 4096, 24
    t = mxgemm.quantize(torch.randn(n, k, device="cuda").mul_(0.02))
    w = mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90")
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    xm = torch.randn(m, k, device="cuda").bfloat16()
    config = SwapAB(32, 1, 2, 1, 6)
    split = fp8_gemm.linear_plan(qd, bs, n, k, m, config, fused=False)
    fused = fp8_gemm.linear_plan(qd, bs, n, k, m, config, fused=True)
    wb = torch.randn(n, k, device="cuda").bfloat16()
    rows = {
        "quantizer, 1 launch": quant,
        "quantizer, 2 launches": twice,
        "graph of 1 launch, replayed": one.replay,
        "graph of 2 launches, replayed": two.replay,
        "torch.empty (the FP8 linear's buffer)": lambda: torch.empty((m + 64, n), dtype=torch.bfloat16, device="cuda"),
        "FP8 linear 6144x4096 M=24, quantizer + GEMM": lambda: split(xm, None),
        "FP8 linear 6144x4096 M=24, fused": lambda: fused(xm, None),
        "bf16 F.linear 6144x4096 M=24": lambda: F.linear(xm, wb),
    }
    with torch.inference_mode():
        result = {name: per_call_us(fn, args.calls, args.repeats, warmup=100) for name, fn in rows.items()}
    out = {"device": environment(mxgemm.describe_device()), "us_per_call": result}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print("| what | µs per call (host) |\n|---|---|")
    for name, us in result.items():
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
