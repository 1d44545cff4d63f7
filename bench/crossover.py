"""Measure the M from which the quantized regime (1x128 activations, blockwise FP8) beats the exact one on the same
re-encoded weight: the exact path as ``hybrid_sm90`` runs it below its crossover (the CUDA small-M kernel up to
M = 16 where built, else the Triton kernel) against cuBLASLt and our FP8 kernel (default config) above.

Run on the device: PYTHONPATH=src python3 bench/crossover.py  (writes $OUT/crossover.json, prints a table).
Earlier version (bench/results/crossover-h200.json): Triton against cuBLASLt only, M = 16-256.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial

import torch

import mxgemm
from mxgemm.backends.hybrid_sm90 import fp8_default, small_m_default
from mxgemm.bench import MODELS
from mxgemm.kernels import fp8_gemm, small_m
from mxgemm.kernels.cublaslt import blockwise_linear
from mxgemm.kernels.w8a16 import default_config, w8a16_linear
from mxgemm.timing import copies_for_cold_l2, time_cuda


def exact(x, w):
    """What hybrid_sm90 runs below its crossover."""
    n, k = w.out_features, w.in_features
    if x.shape[0] <= small_m.MAX_M and w.info.get("small_m"):
        qd = w.tensors["qdata"]
        return small_m.small_m_linear(x, qd, w.tensors["block_scale"], n, small_m_default(*qd.shape))
    q = w.tensors["qdata"][:n].view(torch.uint8)
    cfg = default_config(x.shape[0], n, k, block_scaled=True)
    return w8a16_linear(x, q, w.tensors["block_scale"], None, block_scaled=True, config=cfg)


def fp8(x, w, sms):
    qd = w.tensors["qdata"]
    cfg = fp8_default(x.shape[0], *qd.shape, sms)
    return fp8_gemm.fp8_linear(x, qd, w.tensors["block_scale"], w.out_features, cfg)


def cublas(x, w):
    return blockwise_linear(x, w.tensors["qdata"], w.tensors["block_scale"], w.out_features, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16, 32, 48, 64, 96, 128])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    built = bool(fp8_gemm.fp8_gemm_status(dev.capability))
    rows = []
    for model in args.models:
        for n, k, name in MODELS[model]:
            weights = []
            for seed in range(copies_for_cold_l2(n * k, dev.l2_bytes)):
                g = torch.Generator().manual_seed(seed)
                t = mxgemm.quantize((torch.randn(n, k, generator=g) * 0.02).cuda())
                weights.append(mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90"))
            for m in args.m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row = {"model": model, "name": name, "N": n, "K": k, "M": m,
                       "exact_us": time_cuda([partial(exact, x, w) for w in weights]),
                       "cublas_us": time_cuda([partial(cublas, x, w) for w in weights]),
                       "fp8_us": time_cuda([partial(fp8, x, w, dev.multiprocessors) for w in weights])
                       if built else None}  # fmt: skip
                rows.append(row)
                print(f"{model:11s} {name:8s} M={m:4d}  exact {row['exact_us']:8.1f}  cublas {row['cublas_us']:8.1f}  "
                      f"fp8 {row['fp8_us'] or float('nan'):8.1f} us", flush=True)  # fmt: skip
            del weights
            torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "crossover.json"), "w") as f:
        json.dump({"device": str(dev), "rows": rows}, f, indent=1)
    print("\nfirst M where the quantized regime (the faster of cuBLASLt and the FP8 kernel) wins, per shape:")
    for model in args.models:
        for n, k, name in MODELS[model]:
            mine = [r for r in rows if (r["N"], r["K"]) == (n, k)]
            wins = [r["M"] for r in mine if min(r["cublas_us"], r["fp8_us"] or float("inf")) < r["exact_us"]]
            print(f"{model} {name} N={n} K={k}: {min(wins) if wins else f'> {max(args.m)}'}")


if __name__ == "__main__":
    main()
