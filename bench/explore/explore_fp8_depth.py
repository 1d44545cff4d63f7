"""Exploration: deeper TMA rings for the FP8 kernel where few CTAs share an SM (docs/performance.md).

explore_stream_floor.py measured the kernel as built streaming at 3.15 TB/s at M = 64 on N = 4096 against 3.94 for
its weight stream alone (`ring-only`) and 4.57 for a plain read: with the activation tile and the MMA in each stage,
six stages keep too few weight bytes in flight per SM (48 KiB with one CTA per SM). Rings of 8, 10 and 12 stages are
built here (one warpgroup, 8-64 tokens) in a patched copy of the kernel and every config with them is timed beside
the shipped depths on the M = 64 misses and the M = 16 ones (explore_fp8_bounds.py's rows). Each config's output is
compared with that of the first config with the same K splits: the ring depth does not change the arithmetic, so
they must be bitwise equal (the split count does: it changes the order of the sum). The committed run
(explore-fp8-depth-h200.json, commit ec0f837) compared every config with the default one, so its `mismatch` lists
name the configs of 1 and 4 splits; every config of the default's 2 splits matched bitwise.

Run on the device: cd bench && PYTHONPATH=../src python3 explore_fp8_depth.py [--json ...]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from explore_fp8_bounds import patched_library, problems

import mxgemm
from mxgemm.kernels import fp8_gemm
from mxgemm.timing import SETTLE_MS, time_cuda

DEEP = (8, 10, 12)
DEPTHS = [("  if (stages == 6) return launch<TN, RW, 6>(W, X, a, splits, pdl, st);\n",
           "  if (stages == 6) return launch<TN, RW, 6>(W, X, a, splits, pdl, st);\n"
           "  if constexpr (RW == 1 && TN <= 64) {\n"
           + "".join(f"    if (stages == {d}) return launch<TN, RW, {d}>(W, X, a, splits, pdl, st);\n" for d in DEEP)
           + "  }\n")]  # fmt: skip


def key(cfg: dict) -> str:
    return f"rw{cfg['RW']}-s{cfg['SPLITS']}-st{cfg['ST']}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    cap = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lib = patched_library("deep", DEPTHS, cap)
    fp8_gemm.library = lambda _cap: lib
    fp8_gemm.STAGES = (*fp8_gemm.STAGES, *DEEP)  # valid_config reads it
    rows = []
    for row, ws, xq, xs in problems(dev):
        m, n = row["M"], row["N"]
        np_, kp = ws[0].tensors["qdata"].shape
        default = fp8_gemm.default_config(m, np_, kp, sms)
        run = partial(fp8_gemm.fp8_gemm, xq, xs, m)
        w0 = ws[0].tensors
        refs = {}  # K splits -> the output of the first config with them
        row |= {"default": default, "us": {}, "mismatch": []}
        for cfg in [c for c in fp8_gemm.tactic_configs(m, kp) if c["RW"] == 1]:
            y = run(w0["qdata"], w0["block_scale"], n, cfg, False)
            if not torch.equal(y, refs.setdefault(cfg["SPLITS"], y)):
                row["mismatch"].append(key(cfg))
            calls = [partial(run, w.tensors["qdata"], w.tensors["block_scale"], n, cfg, False) for w in ws]
            row["us"][key(cfg)] = time_cuda(calls, warmup_ms=SETTLE_MS)
        best = min(row["us"], key=row["us"].get)
        shallow = min((c for c in row["us"] if int(c.split("st")[1]) <= 6), key=row["us"].get)
        row |= {"best": best, "best_shallow": shallow}
        rows.append(row)
        print(f"{row['model']} {row['name']} M={m} floor {row['floor_us']:.1f} default {key(default)} "
              f"{row['us'][key(default)]:.1f} best<=6 {shallow} {row['us'][shallow]:.1f} best {best} "
              f"{row['us'][best]:.1f} mismatches {row['mismatch']}", flush=True)  # fmt: skip
    print("\n| model | shape | M | floor | default | best of ST <= 6 | best | best config | % floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        u = r["us"]
        print(f"| {r['model']} | {r['name']} | {r['M']} | {r['floor_us']:.1f} | {u[key(r['default'])]:.1f} | "
              f"{u[r['best_shallow']]:.1f} | {u[r['best']]:.1f} | {r['best']} | "
              f"{100 * r['floor_us'] / u[r['best']]:.0f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
