"""Where the host time of a planned cuBLASLt call (the CUDA quantizer and cuBLASLt's blockwise GEMM in one ctypes
call, hybrid_sm90's path from M = 128-256 up) goes, and whether our FP8 kernel (tokens as wgmma M, graphed with its
quantizer) would serve M = 512-2048 instead: per shape and M, the host time to enqueue (GPU held busy) and the
device time under graph replay of the plan's launcher, of its ctypes call alone into a buffer allocated once, and of
FP8 plans of a few configs; the FP8 output's largest difference from cuBLASLt's relative to its largest value.

Run on the device: PYTHONPATH=src python3 lab/blockwise_host.py --json blockwise-host.json
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from large_m_calls import enqueue_us, replay_us  # beside this script

import mxgemm
from mxgemm.bench import environment
from mxgemm.kernels import cublaslt, fp8_gemm, raw_stream
from mxgemm.kernels.fp8_gemm import TokensAsM

SHAPES = {"q": (4096, 4096), "k": (1024, 4096), "gate": (14336, 4096), "down": (4096, 14336)}
CONFIGS = [TokensAsM(128, 64, 1, 6), TokensAsM(128, 128, 1, 4), TokensAsM(128, 128, 2, 4)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        weight = mxgemm.MXFP8Linear.from_linear(linear, backend="hybrid_sm90")._prepared
        qd, bs = weight.tensors["qdata"], weight.tensors["block_scale"]
        for m in (512, 1024, 2048):
            x = torch.randn(m, k, device="cuda").bfloat16()
            plan = cublaslt.linear_plan(qd, bs, n, k, m, torch.bfloat16)
            free = dict(zip(plan.__code__.co_freevars, (c.cell_contents for c in plan.__closure__), strict=True))
            run, handle, index = free["run"], free["handle"], free["index"]
            buf = torch.empty(free["rows"], qd.shape[0], dtype=torch.bfloat16, device="cuda")
            ref = plan(x, None).float()
            row = {"shape": name, "n": n, "k": k, "m": m, "variants": {}}
            variants = {
                "cublaslt plan": lambda plan=plan, x=x: plan(x, None),
                "cublaslt ctypes": lambda run=run, h=handle, x=x, b=buf, i=index: run(
                    h, x.data_ptr(), x.stride(0), b.data_ptr(), raw_stream(i)
                ),
            }
            for cfg in CONFIGS:
                if cfg.valid(qd.shape[1]):
                    variants[f"fp8 {cfg}"] = fp8_gemm.linear_plan(qd, bs, n, k, m, cfg)
            for who, fn in variants.items():
                if who.startswith("fp8"):
                    out = fn(x, None).float()
                    diff = ((out - ref).abs().max() / ref.abs().max()).item()
                    fn = functools.partial(fn, x, None)
                else:
                    diff = 0.0
                row["variants"][who] = {"enqueue_us": enqueue_us(fn), "replay_us": replay_us(fn), "rel_diff": diff}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| shape | M | variant | enqueue µs | replay µs | rel. diff |\n|---|---|---|---|---|---|")
    for r in rows:
        for who, v in r["variants"].items():
            print(f"| {r['shape']} {r['n']}x{r['k']} | {r['m']} | {who} | {v['enqueue_us']:.1f} | {v['replay_us']:.1f}"
                  f" | {v['rel_diff']:.1e} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(mxgemm.describe_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
