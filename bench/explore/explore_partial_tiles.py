"""Exploration: the FP8 kernel's default config with the activations as the quantizer writes them for cuBLASLt (M
rounded up to 4 rows, so a token tile larger than that reads rows past the tensor, zero-filled by the TMA) against
whole token tiles of zero rows (``quantize_1x128_padded(x, TN)``, what ``fp8_linear`` does for tokens-as-M configs
since docs/performance.md), at M where the swap-AB kernel's tile is partial (1, 4, 20, 24, 40: 8, 8, 32, 32 and 64
tokens per CTA) and M = 72 (tokens as M, 128 per CTA). Outputs are compared bitwise between the two; the quantizer
is inside the timed call, as in the benchmark.

Run on the device: cd bench && PYTHONPATH=../src python3 explore_partial_tiles.py [--json ...]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from explore_fp8_gemm import key
from explore_small_m_pipeline import cold_weights

import mxgemm
from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.act_quant import quantize_1x128_padded
from mxgemm.timing import time_cuda

SHAPES = ((4096, 4096, "8B o"), (8192, 8192, "70B o"), (4096, 14336, "8B down"))


def run(x, w, cfg, rows_multiple):
    xq, xs = quantize_1x128_padded(x, rows_multiple)
    t = w.tensors
    return fp8_gemm.fp8_gemm(xq, xs, x.shape[0], t["qdata"], t["block_scale"], w.out_features, cfg)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 20, 24, 40, 72])
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    rows = []
    for n, k, name in SHAPES:
        ws, _ = cold_weights(n, k, dev.l2_bytes, bf16=False)
        np_, kp = ws[0].tensors["qdata"].shape
        for m in args.m:
            cfg = fp8_gemm.default_config(m, np_, kp, dev.multiprocessors)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            same = torch.equal(run(x, ws[0], cfg, 1), run(x, ws[0], cfg, cfg["TN"]))
            row = {"shape": name, "N": n, "K": k, "M": m, "config": key(cfg), "same_bits": same}
            for label, rows_multiple in (("as_for_cublas", 1), ("whole_tiles", cfg["TN"])):
                row[label] = time_cuda([partial(run, x, w, cfg, rows_multiple) for w in ws])
            rows.append(row)
            print(f"{name:8s} M={m:3d} {row['config']:22s} as for cuBLASLt {row['as_for_cublas']:7.1f} us  whole "
                  f"tiles {row['whole_tiles']:7.1f} us  same bits {same}", flush=True)  # fmt: skip
        del ws
        torch.cuda.empty_cache()
    print("\n| shape | M | config | as for cuBLASLt µs | whole tiles µs | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["as_for_cublas"] / r["whole_tiles"]
        print(f"| {r['shape']} | {r['M']} | {r['config']} | {r['as_for_cublas']:.1f} | {r['whole_tiles']:.1f} | "
              f"{ratio:.2f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
