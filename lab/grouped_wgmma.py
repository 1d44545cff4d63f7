"""The grouped TMA/wgmma kernel (kernels/grouped/wgmma.py) against the Triton grouped kernel's default and bf16
``torch._grouped_mm``, CUDA-graph replay of 8 routings as ``mxgemm bench --moe`` times them; the wgmma kernel with its
row quantizer and alone, each config's output checked against the Triton kernel's.

Run on the device: PYTHONPATH=src python3 lab/grouped_wgmma.py --json $OUT/grouped-wgmma.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

import mxgemm
from mxgemm.bench_moe import MOE_MODELS, experts_with_bf16, routing_offsets
from mxgemm.kernels.grouped.fp8 import default_config, grouped_block_linear
from mxgemm.kernels.grouped.quant import quantize_rows
from mxgemm.kernels.grouped.wgmma import WgmmaConfig, grouped_wgmma
from mxgemm.timing import time_cuda

CONFIGS = [WgmmaConfig(tn, wn, st) for tn in (64, 128) for wn in (64, 128) for st in (4, 6)]
TOKENS = {
    "qwen3-30b-a3b": [64, 256, 1024, 4096],
    "deepseek-v3": [256, 1024, 4096],
    "mixtral-8x7b": [16, 64, 256, 1024, 4096],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--models", nargs="*", default=list(TOKENS))
    args = parser.parse_args()
    out = []
    for model in args.models:
        e, hidden, width, topk = MOE_MODELS[model]
        for proj, (n, k) in (("gate_up", (2 * width, hidden)), ("down", (hidden, width))):
            q, s, w16 = experts_with_bf16(e, n, k, seed=1, device=torch.device("cuda"))
            w = mxgemm.prepare_grouped_weight(q, s)
            del q, s
            w16_t = w16.transpose(1, 2)
            qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
            for tokens in TOKENS[model]:
                rows = tokens * topk
                routings = [routing_offsets(tokens, e, topk, seed=r, device=torch.device("cuda"))[0] for r in range(8)]
                xs = [torch.randn(rows, k, device="cuda").bfloat16() for _ in routings]
                quantized = [quantize_rows(x) for x in xs]
                ref = grouped_block_linear(xs[0], qd, bs, routings[0], n).float()
                res = {
                    "triton": time_cuda(
                        [partial(grouped_block_linear, x, qd, bs, o, n) for x, o in zip(xs, routings, strict=True)]
                    ),
                    "bf16": time_cuda(
                        [partial(torch._grouped_mm, x, w16_t, offs=o) for x, o in zip(xs, routings, strict=True)]
                    ),
                    "quantize_rows": time_cuda([partial(quantize_rows, x) for x in xs]),
                }
                errs = {}
                for c in CONFIGS:
                    y = grouped_wgmma(*quantized[0], rows, qd, bs, routings[0], n, torch.bfloat16, c).float()
                    errs[str(c)] = ((y - ref).norm() / ref.norm()).item()
                    res[f"gemm {c}"] = time_cuda(
                        [
                            partial(grouped_wgmma, *xq, rows, qd, bs, o, n, torch.bfloat16, c)
                            for xq, o in zip(quantized, routings, strict=True)
                        ]
                    )
                best = min(CONFIGS, key=lambda c: res[f"gemm {c}"])
                flops = 2 * rows * n * k
                line = (
                    f"{model:14s} {proj:7s} T={tokens:5d} per={rows // e:5d} triton {res['triton']:8.1f}  "
                    f"bf16 {res['bf16']:8.1f}  quant {res['quantize_rows']:6.1f}  best {best}: "
                    f"{res[f'gemm {best}']:8.1f} ({flops / res[f'gemm {best}'] / 1e6:.0f} TFLOP/s, "
                    f"max rel err vs triton {max(errs.values()):.1e})"
                )
                print(line, flush=True)
                out.append(
                    {
                        "model": model,
                        "proj": proj,
                        "tokens": tokens,
                        "rows": rows,
                        "E": e,
                        "N": n,
                        "K": k,
                        "default_triton": str(default_config(rows, e)),
                        "us": res,
                        "rel_err": errs,
                    }
                )
            del w, w16, w16_t
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
