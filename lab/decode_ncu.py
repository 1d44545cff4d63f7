"""One-token grouped GEMM and the plain read of the same bytes, for Nsight Compute: the grouped Triton kernel with
its default config on one routing of ``mxgemm bench --moe``'s problem, then ``lab/read_floor.py``'s read kernel
(16 KB a program, 2 KB loads, 8 warps) over the same active experts, each three times.

ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
    -k regex:"_grouped_kernel|_read" -s 2 -c 2 python3 lab/decode_ncu.py --proj gate_up
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import mxgemm
from mxgemm.bench_moe import MOE_MODELS, experts_with_bf16, routing_offsets
from mxgemm.kernels.grouped.fp8 import default_config, grouped_block_linear

sys.path.insert(0, str(Path(__file__).parent))
from read_floor import _read


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MOE_MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--proj", choices=("gate_up", "down"), default="gate_up")
    parser.add_argument("--tokens", type=int, default=1)
    args = parser.parse_args()
    e, hidden, width, topk = MOE_MODELS[args.model]
    n, k = (2 * width, hidden) if args.proj == "gate_up" else (hidden, width)
    dev = torch.device("cuda")
    q, s, _ = experts_with_bf16(e, n, k, seed=1, device=dev)
    w = mxgemm.prepare_grouped_weight(q, s)
    qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
    offsets, _ = routing_offsets(args.tokens, e, topk, seed=0, device=dev)
    x = torch.randn(args.tokens * topk, k, device=dev).bfloat16()
    config = default_config(x.shape[0], e)
    print(f"{args.model} {args.proj} T={args.tokens}: {config}")
    for _ in range(3):
        grouped_block_linear(x, qd, bs, offsets, n, config)
    words = qd.view(torch.int32).view(e, -1)
    ids = torch.nonzero(torch.diff(offsets, prepend=offsets.new_zeros(1))).flatten().int()
    chunk = 4096
    sink = torch.empty(len(ids) * (words.shape[1] // chunk), dtype=torch.int32, device=dev)
    for _ in range(3):
        _read[(len(ids), words.shape[1] // chunk)](
            words, ids, sink, words.shape[1], CHUNK=chunk, BLOCK=512, num_warps=8
        )
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
