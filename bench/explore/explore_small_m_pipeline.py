"""Exploration: every config of the small-M CUDA kernel (row tiles, K splits summed in a cluster, depth of the
cp.async shared-memory ring) against bf16 cuBLAS, `auto` and the kernel's default config, on the 8B / 70B /
7168-hidden projections at small M.

Each config is first checked against an fp64 reference on an odd shape (random weight bytes: every finite E4M3 code),
then timed as the benchmark times (graph replay, weights rotated beyond 3x L2, median). Prints a table last.

Run on the device:
    PYTHONPATH=src python3 bench/explore/explore_small_m_pipeline.py --json explore-small-m-pipeline-h200.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.bench import MODELS, Problem, floor_us
from mxgemm.kernels import small_m
from mxgemm.timing import copies_for_cold_l2, time_cuda


def configs(w, m: int) -> list[dict]:
    """The kernel configs `hybrid_sm90` offers the tuner for this weight and M (its default first)."""
    return [t["config"] for t in mxgemm.backends.get_backend("hybrid_sm90").tactics(m, w) if t["path"] == "cuda"]


def key(cfg: dict) -> str:
    return f"rt{cfg['RT']}-s{cfg['SPLITS']}-st{cfg['ST']}"


def random_mx(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weight bytes (every finite E4M3 code) with one scale: the 128x128 re-encoding is exact."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8, device="cuda")
    q[(q & 0x7F) == 0x7F] = 0x3C
    return q.view(torch.float8_e4m3fn), torch.full((n, k // 32), 120, dtype=torch.uint8, device="cuda")


def hybrid(q: torch.Tensor, s: torch.Tensor):
    return mxgemm.prepare_weight(q, s, backend="hybrid_sm90")


def cold_weights(n: int, k: int, l2_bytes: int, bf16: bool = True) -> tuple[list, list]:
    """Enough random [n, k] weights to rotate beyond 3x the L2: each as hybrid_sm90 prepares it, and as bf16 (its
    exact values) for cuBLAS (an empty list with ``bf16=False``)."""
    mx = [random_mx(n, k, seed) for seed in range(copies_for_cold_l2(n * k, l2_bytes))]
    dense = [mxgemm.dequantize(mxgemm.MXTensor(q, s), torch.bfloat16) for q, s in mx] if bf16 else []
    return [hybrid(q, s) for q, s in mx], dense


def run(x, w, cfg):
    return small_m.small_m_linear(x, w.tensors["qdata"], w.tensors["block_scale"], w.out_features, cfg)


def check() -> dict:
    n, k = 4160, 8000  # padded to 8192: up to 8 splits; 130 tiles of 32 rows
    q, s = random_mx(n, k, 0)
    w = hybrid(q, s)
    wf = mxgemm.dequantize(mxgemm.MXTensor(q, s), torch.float32).double()
    errs = {}
    for m in (1, 5, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ wf.T
        for cfg in configs(w, m):
            y = run(x, w, cfg)
            errs[f"m{m}-{key(cfg)}"] = ((y.double() - ref).norm() / ref.norm()).item()
    bad = {k_: e for k_, e in errs.items() if not e < 4e-3}
    print(f"correctness: {len(errs)} runs, worst rel err {max(errs.values()):.2e}, bad: {bad}", flush=True)
    return errs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    args = parser.parse_args()
    t0 = time.time()
    small_m.library(torch.cuda.get_device_capability())
    print(f"kernel built/loaded in {time.time() - t0:.1f} s", flush=True)
    dev = mxgemm.describe_device()
    errs = check()
    rows = []
    for model in args.models:
        for n, k, name in MODELS[model]:
            ws, bf16 = cold_weights(n, k, dev.l2_bytes)
            np_, kp = ws[0].tensors["qdata"].shape
            for m in args.m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row = {"model": model, "name": name, "M": m, "N": n, "K": k,
                       "floor_us": floor_us(Problem(m, n, k), dev),
                       "bf16": time_cuda([partial(F.linear, x, b) for b in bf16]),
                       "auto": time_cuda([partial(mxgemm.linear, x, w) for w in ws]), "us": {}}  # fmt: skip
                for cfg in configs(ws[0], m):  # the default config first
                    row["us"][key(cfg)] = time_cuda([partial(run, x, w, cfg) for w in ws])
                row["default"] = row["us"][key(small_m.default_config(np_, kp))]
                fam = {}
                for kk, us in row["us"].items():
                    f = kk.split("-")[-1]  # ring depth
                    if f not in fam or us < fam[f][1]:
                        fam[f] = (kk, us)
                row["best"] = fam
                rows.append(row)
                print(f"{model} {name:8s} M={m:2d} floor {row['floor_us']:5.1f} bf16 {row['bf16']:5.1f} "
                      f"auto {row['auto']:5.1f} default {row['default']:5.1f} | "
                      + " | ".join(f"{f} {v[1]:5.1f} {v[0]}" for f, v in sorted(fam.items())), flush=True)  # fmt: skip
            del ws, bf16
            torch.cuda.empty_cache()
    fams = ["st2", "st3"]
    print("\n| model | shape | M | floor | bf16 | auto | default | " + " | ".join(fams) + " | best x bf16 | best |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(fams) + "---|---|")
    for r in rows:
        best = min(r["best"].values(), key=lambda v: v[1])
        cells = " | ".join(f"{r['best'][f][1]:.1f}" if f in r["best"] else "-" for f in fams)
        print(f"| {r['model']} | {r['name']} | {r['M']} | {r['floor_us']:.1f} | {r['bf16']:.1f} | {r['auto']:.1f} | "
              f"{r['default']:.1f} | {cells} | {r['bf16'] / best[1]:.2f} | {best[0]} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "checks": errs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
