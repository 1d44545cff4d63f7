"""Run the grouped FP8 GEMM of one `mxgemm bench --moe` problem a few times, for Nsight Compute: mxgemm's wgmma
kernel with the config the backend picks (or ``--tn/--wn/--stages``), or DeepGEMM's contiguous kernel on the same
experts and routing (where ``deep_gemm`` imports; GEMM only, rows padded per expert to 128).

ncu --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:grouped_kernel -s 2 \\
    -c 1 python3 lab/grouped_ncu.py --model qwen3-30b-a3b --proj down --tokens 4096
ncu ... -k regex:fp8_gemm -s 2 -c 1 python3 lab/grouped_ncu.py --deepgemm --model qwen3-30b-a3b ...
"""

from __future__ import annotations

import argparse

import torch

import mxgemm
from mxgemm import bench_moe
from mxgemm.kernels.grouped.quant import quantize_rows
from mxgemm.kernels.grouped.wgmma import WgmmaConfig, grouped_wgmma


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(bench_moe.MOE_MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--proj", choices=("gate_up", "down"), default="down")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--tn", type=int)
    parser.add_argument("--wn", type=int, default=128)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--deepgemm", action="store_true")
    args = parser.parse_args()
    e, hidden, width, topk = bench_moe.MOE_MODELS[args.model]
    n, k = (2 * width, hidden) if args.proj == "gate_up" else (hidden, width)
    dev = torch.device("cuda")
    weight = mxgemm.prepare_grouped_weight(*bench_moe.random_experts(e, n, k, seed=n + k, device=dev))
    counts = bench_moe.routing_counts(args.tokens, e, topk, seed=0)
    if args.deepgemm:
        bench_moe.deepgemm_prebuild([(e, n, k, counts)], jobs=16)
        run = bench_moe.deepgemm_calls(weight, [counts], k, dev)["deepgemm_contiguous"][0]
        what = "DeepGEMM contiguous"
    else:
        rows = sum(counts)
        offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(dev)
        xq, xs = quantize_rows(torch.randn(rows, k, device=dev).bfloat16())
        t = weight.tensors
        cfg = WgmmaConfig(args.tn or (128 if rows // e >= 128 else 64), args.wn, args.stages)
        qd = t["qdata"].view(torch.uint8)

        def run():
            return grouped_wgmma(xq, xs, rows, qd, t["block_scale"], offsets, n, torch.bfloat16, cfg)

        what = str(cfg)
    for _ in range(4):
        run()
    torch.cuda.synchronize()
    print(f"{args.model} {args.proj} [{e}, {n}, {k}] at {args.tokens} tokens: {what}")


if __name__ == "__main__":
    main()
