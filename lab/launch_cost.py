"""Host time of an eager call on the device machine, taken apart: each layer of the path of an ``MXFP8Linear``
call, from the module down to its one ctypes call, against bf16's ``nn.Linear`` and ``F.linear``; and the launch
primitives under it.

Per call, ``--calls`` back to back, synchronized once at the end, best of ``--repeats`` rounds. The decomposed path
runs a 1024 x 1024 weight (device time a few µs, under the host's), at M = 4 (the small-M kernel) and M = 24 (the
quantizer and the FP8 GEMM): the module call on [M, 1, K] and on [M, K] activations; ``mxgemm.linear``;
``run_planned``; the weight's plan (the backend's closures); the kernel binding's launcher, graphed (one launch of
the plan's CUDA graph) and not (two launches); its ctypes call alone into a buffer allocated
once; ``torch.empty`` of its buffer (a size tuple and as integers) and the slice of the output rows. Then the launch
primitives: one and two CUDA quantizer launches on 4 x 128 activations, and a CUDA graph of each replayed.

Run on the device: PYTHONPATH=src python3 lab/launch_cost.py --json launch-cost.json
"""

from __future__ import annotations

import argparse
import ctypes
import json

import torch
import torch.nn.functional as F
from op_overhead import per_call_us  # beside this script (its folder is on sys.path when run)

import mxgemm
from mxgemm.bench import environment
from mxgemm.kernels import fp8_gemm, raw_stream, small_m
from mxgemm.ops import run_planned


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


def path_rows(m: int) -> dict:
    """The layers of an eager call of a 1024 x 1024 ``MXFP8Linear`` at M rows, outermost first, and bf16's."""
    n = k = 1024
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    layer = mxgemm.MXFP8Linear.from_linear(linear, backend="hybrid_sm90")
    w = layer._prepared
    x = torch.randn(m, k, device="cuda").bfloat16()
    layer(x)  # the plan for M
    (plan,) = w.plans.launch.values()
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    backend = mxgemm.backends.get_backend("hybrid_sm90")
    tactic = backend.choose(m, w)
    capability = torch.cuda.get_device_capability()
    if m <= small_m.MAX_M:
        graphed = small_m.linear_plan(qd, bs, n, k, m, tactic.config)
        launches = {"launcher, not graphed": small_m.linear_plan(qd, bs, n, k, m, tactic.config, graphed=False)}
        address, fn = ctypes.addressof(graphed.keep), small_m.library(capability).mxgemm_small_m_run
        call = lambda: fn(address, x.data_ptr(), None, out.data_ptr(), raw_stream(0))  # noqa: E731
        rows = m
    else:
        graphed = fp8_gemm.linear_plan(qd, bs, n, k, m, tactic.config)
        launches = {"launcher, 2 launches": fp8_gemm.linear_plan(qd, bs, n, k, m, tactic.config, graphed=False)}
        address = ctypes.addressof(graphed.keep[torch.bfloat16, False, False])  # the Python launcher's bf16 plan
        fn = fp8_gemm.library(capability).mxgemm_fp8_linear_run
        call = lambda: fn(address, x.data_ptr(), x.stride(0), None, out.data_ptr(), raw_stream(0))  # noqa: E731
        rows = m + 256  # at least the launcher's buffer: the output, the quantized activations, their scales
    bf16 = torch.bfloat16
    out = torch.empty((rows, n), dtype=bf16, device="cuda")
    x3 = x.view(m, 1, k)  # as a decode step of M sequences passes them
    return {
        f"M={m} MXFP8Linear module call, [M, 1, K]": lambda: layer(x3),
        f"M={m} MXFP8Linear module call": lambda: layer(x),
        f"M={m} mxgemm.linear": lambda: mxgemm.linear(x, w),
        f"M={m} run_planned": lambda: run_planned(x, w, None),
        f"M={m} the weight's plan": lambda: plan(x, None),
        f"M={m} launcher, graphed": lambda: graphed(x, None),
        **{f"M={m} {name}": (lambda f=f: f(x, None)) for name, f in launches.items()},
        f"M={m} ctypes call alone, graphed": call,
        f"M={m} torch.empty(tuple, dtype=, device=)": lambda: torch.empty((rows, n), dtype=bf16, device="cuda"),
        f"M={m} torch.empty(ints, dtype=, device=)": lambda: torch.empty(rows, n, dtype=bf16, device="cuda"),
        f"M={m} slice of the output rows": lambda: out[:m],
        f"M={m} bf16 nn.Linear module call, [M, 1, K]": lambda: linear(x3),
        f"M={m} bf16 nn.Linear module call": lambda: linear(x),
        f"M={m} bf16 F.linear": lambda: F.linear(x, linear.weight),
    }


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

    rows = {
        **path_rows(4),
        **path_rows(24),
        "quantizer, 1 launch": quant,
        "quantizer, 2 launches": twice,
        "graph of 1 launch, replayed": one.replay,
        "graph of 2 launches, replayed": two.replay,
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
