"""Exploration: the FP8 kernel with tokens as wgmma's M (`fp8_gemm_tokm_kernel`, configs with a ``WN`` key) against
the shipped path (`auto`: the tuned swap-AB config or cuBLASLt), cuBLASLt's blockwise GEMM and bf16 cuBLAS at M = 64,
128 and 256 on the 8B / 70B / 7168-hidden projections (docs/performance.md).

Every tokens-as-M config is first checked against the emulated twin on odd shapes, into an output filled with NaN
(every element must be written), then timed as the benchmark times (graph replay, weights rotated beyond 3x L2,
median; the activation quantizer inside the timed call). Prints a table last.

Run on the device: cd bench && PYTHONPATH=../src python3 explore_fp8_tokm.py [--m 64 128 256] [--json ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import explore_fp8_gemm
import torch
from explore_fp8_gemm import baselines, key, run
from explore_small_m_pipeline import cold_weights

import mxgemm
from mxgemm.bench import MODELS
from mxgemm.kernels import fp8_gemm
from mxgemm.timing import time_cuda


def configs(m: int, kp: int, stages=(2, 4, 6), splits=(1, 2, 4)) -> list[dict]:
    tiles = (64,) if m <= 64 else (64, 128)
    out = [{"TN": tn, "WN": wn, "SPLITS": sp, "ST": st}
           for tn, wn, sp, st in itertools.product(tiles, (64, 128), splits, stages)]  # fmt: skip
    return [c for c in out if fp8_gemm.valid_config(c, kp)]


def check() -> dict:
    # K = 1408 (12 blocks): 3 per split with 4 splits, an odd count
    shapes = ((4160, 8000), (130, 96), (4096, 4096), (6144, 4096), (256, 1408))
    return explore_fp8_gemm.check(configs, shapes, (1, 17, 64, 100, 256, 300))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--m", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 6])
    # 4 splits were never the best at M >= 64 (explore-fp8-tokm-h200.json of item 24)
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    errs = check()
    if not max(errs.values()) < 4e-3:
        return
    rows = []
    for model in args.models:
        for n, k, name in MODELS[model]:
            ws, bf16 = cold_weights(n, k, dev.l2_bytes)
            kp = ws[0].tensors["qdata"].shape[1]
            for m in args.m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row = baselines(model, name, m, n, k, x, ws, bf16, dev)
                row["us"] = {
                    key(c): time_cuda([partial(run, x, w, c) for w in ws])
                    for c in configs(m, kp, args.stages, args.splits)
                }
                row["best"] = min(row["us"].items(), key=lambda kv: kv[1])
                rows.append(row)
                save(args.json, dev, errs, rows)  # as it goes: a run cut short keeps its rows
                print(f"{model} {name:8s} M={m:3d} floor {row['floor_us']:6.1f} bf16 {row['bf16']:6.1f} auto "
                      f"{row['auto']:6.1f} cublas {row['cublas']:6.1f} tokm {row['best'][1]:6.1f} "
                      f"({row['best'][0]})", flush=True)  # fmt: skip
            del ws, bf16
            torch.cuda.empty_cache()
    print("\n| model | shape | M | floor | bf16 | auto | cuBLASLt | tokm best | config | x bf16 auto | x bf16 tokm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cfg, us = r["best"]
        print(
            f"| {r['model']} | {r['name']} | {r['M']} | {r['floor_us']:.1f} | {r['bf16']:.1f} | {r['auto']:.1f} | "
            f"{r['cublas']:.1f} | {us:.1f} | {cfg} | {r['bf16'] / r['auto']:.2f} | {r['bf16'] / us:.2f} |"
        )


def save(path, dev, errs, rows) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": str(dev), "checks": errs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
