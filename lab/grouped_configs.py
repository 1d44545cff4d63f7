"""Configs of the grouped FP8 kernel (kernels/grouped/fp8.py) against each other, CUDA-graph replay of 8 routings
(as mxgemm bench --moe times), with the 1x128 quantizer alone for scale; each config's output checked against the
default's.

Run on the device: PYTHONPATH=src python3 lab/grouped_configs.py --json $OUT/grouped-configs.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

import mxgemm
from mxgemm.bench_moe import MOE_MODELS, experts_with_bf16, routing_offsets
from mxgemm.kernels.act_quant import quantize_1x128_padded
from mxgemm.kernels.grouped.fp8 import GroupedConfig, default_config, grouped_block_linear
from mxgemm.timing import time_cuda

C = GroupedConfig
DECODE = [C(32, 16), C(64, 16), C(64, 16, 4, 4), C(128, 16), C(64, 16, 8, 3), C(64, 32), C(64, 64, 4, 3)]
PREFILL = [
    C(128, 64, 8, 3),
    C(128, 128, 8, 3),
    C(128, 64, 4, 3, True),
    C(128, 128, 8, 3, True),
    C(128, 128, 8, 4, True),
    C(128, 128, 4, 3, True),
    C(256, 128, 8, 3, True),
    C(128, 256, 8, 3, True),
    C(256, 64, 8, 3, True),
    C(64, 128, 4, 3, True),
]
PROBLEMS = [
    ("qwen3-30b-a3b", "gate_up", [1, 16, 256, 1024, 4096]),
    ("qwen3-30b-a3b", "down", [1, 1024, 4096]),
    ("mixtral-8x7b", "gate_up", [1, 64, 256, 1024, 4096]),
    ("deepseek-v3", "gate_up", [1, 1024]),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    out = []
    for model, proj, token_counts in PROBLEMS:
        e, hidden, width, topk = MOE_MODELS[model]
        n, k = (2 * width, hidden) if proj == "gate_up" else (hidden, width)
        q, s, _ = experts_with_bf16(e, n, k, seed=1, device=torch.device("cuda"))
        w = mxgemm.prepare_grouped_weight(q, s)
        del q, s
        qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
        for tokens in token_counts:
            rows = tokens * topk
            routings = [routing_offsets(tokens, e, topk, seed=r, device=torch.device("cuda"))[0] for r in range(8)]
            xs = [torch.randn(rows, k, device="cuda").bfloat16() for _ in routings]
            base = default_config(rows, e)
            ref = grouped_block_linear(xs[0], qd, bs, routings[0], n, base)
            quant_us = time_cuda([partial(quantize_1x128_padded, x) for x in xs])
            results = {}
            for cfg in [base, *(DECODE if rows // e < 64 else PREFILL)]:
                if str(cfg) in results:
                    continue
                y = grouped_block_linear(xs[0], qd, bs, routings[0], n, cfg)
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                calls = [partial(grouped_block_linear, x, qd, bs, o, n, cfg) for x, o in zip(xs, routings, strict=True)]
                results[str(cfg)] = (time_cuda(calls, warmup_ms=20), err)
            best = min(results, key=lambda c: results[c][0])
            print(
                f"{model} {proj} T={tokens} rows={rows} quantizer {quant_us:.1f} us; default {base}: "
                f"{results[str(base)][0]:.1f}; best {best}: {results[best][0]:.1f}"
            )
            for cfg, (us, err) in sorted(results.items(), key=lambda r: r[1][0]):
                print(f"    {us:9.1f}  err {err:.1e}  {cfg}")
            out.append(
                {
                    "model": model,
                    "proj": proj,
                    "tokens": tokens,
                    "quantizer_us": quant_us,
                    "default": str(base),
                    "results": results,
                }
            )
        del w
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
