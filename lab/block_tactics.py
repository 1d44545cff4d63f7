"""The routed block (``moe_experts``' Triton path) timed with each of gate/up's tactics, beside the projection alone.

The tuner times a gate/up tactic on ``grouped_linear`` (plain rows, ``bn`` weight rows a program), while the block
runs a Triton tactic in its gated form: ``bn / 2`` gate rows and ``bn / 2`` up rows a program, ``silu(gate) * up`` in
the epilogue. This times, at each token count, the block with every gate/up tactic the backend offers (down on its
default) and gate/up alone on ``grouped_linear`` with the same tactic, both under CUDA-graph replay of 8 routings as
``mxgemm bench --moe`` times them, so that the two rankings can be compared (Qwen3-30B-A3B's block at 4 tokens took
67.0 µs with the tactic of 128 weight rows and 77.8-79.2 with the one of 64 that the tuning files hold since).

Run on the device: PYTHONPATH=src python3 lab/block_tactics.py --json $OUT/block-tactics.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

import mxgemm
from mxgemm.backends import get_backend
from mxgemm.backends.base import tactic_json
from mxgemm.bench_moe import MOE_MODELS, random_experts, routing_offsets, top_k_routing
from mxgemm.timing import time_cuda

ROUTINGS = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MOE_MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = torch.device("cuda")
    e, hidden, width, topk = MOE_MODELS[args.model]
    gate_up = mxgemm.prepare_grouped_weight(*random_experts(e, 2 * width, hidden, seed=1, device=dev))
    down = mxgemm.prepare_grouped_weight(*random_experts(e, hidden, width, seed=2, device=dev))
    backend = get_backend(gate_up.backend)
    out = []
    for tokens in args.tokens:
        rows = tokens * topk
        picks = [top_k_routing(tokens, e, topk, seed=r, device=dev) for r in range(ROUTINGS)]
        xs = [torch.randn(tokens, hidden, device=dev).bfloat16() for _ in picks]
        offs = [routing_offsets(tokens, e, topk, seed=r, device=dev)[0] for r in range(ROUTINGS)]
        xr = [torch.randn(rows, hidden, device=dev).bfloat16() for _ in offs]
        ref = backend.run_experts(xs[0], *picks[0], gate_up, down)
        per = -(-rows // e)
        print(f"== {args.model} T={tokens} ({per} rows an expert)")
        for tactic in backend.grouped_tactics(per, gate_up):
            y = backend.run_experts(xs[0], *picks[0], gate_up, down, (tactic, None))
            block = time_cuda(
                [
                    partial(backend.run_experts, x, i, w, gate_up, down, (tactic, None))
                    for x, (i, w) in zip(xs, picks, strict=True)
                ],
                warmup_ms=20,
            )
            alone = time_cuda(
                [partial(backend.run_grouped, x, gate_up, o, tactic) for x, o in zip(xr, offs, strict=True)],
                warmup_ms=20,
            )
            name = json.dumps(tactic_json(tactic), separators=(",", ":"))
            same = torch.equal(y, ref)
            print(f"   block {block:8.1f}   gate/up alone {alone:8.1f}   same bits {same}   {name}")
            out.append({"tokens": tokens, "tactic": name, "block_us": block, "gate_up_us": alone, "same_bits": same})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
