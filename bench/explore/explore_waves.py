"""Exploration: does the small-M kernel lose its ~20% of the floor on large weights to wave tails?

At M = 1 the kernel's time is bytes over bandwidth plus what the grid's shape costs. Sweeping N at a fixed K in steps
of one CTA row block per SM-wave fraction shows it: if tails matter, time per weight byte rises just past each whole
number of waves (a saw-tooth in % of floor); if not, % of floor is flat in N. Timed as the benchmark times (graph
replay, weights rotated beyond 3x L2, median). Prints a table last.

Run on the device: cd bench && PYTHONPATH=../src python3 explore_waves.py --json explore-waves-h200.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from explore_small_m_pipeline import hybrid, random_mx

import mxgemm
from mxgemm.bench import Problem, floor_us
from mxgemm.kernels import small_m
from mxgemm.timing import copies_for_cold_l2, time_cuda

CONFIGS = ({"RT": 1, "SPLITS": 1, "ST": 2}, {"RT": 1, "SPLITS": 1, "ST": 3}, {"RT": 2, "SPLITS": 1, "ST": 2})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--k", type=int, nargs="+", default=[8192])
    parser.add_argument("--n", type=int, nargs=3, default=[8192, 32768, 512], help="start stop step")
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    rows = []
    for k in args.k:
        for n in range(*args.n):
            ws = [hybrid(*random_mx(n, k, seed)) for seed in range(copies_for_cold_l2(n * k, dev.l2_bytes))]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            floor = floor_us(Problem(1, n, k), dev)
            row = {"N": n, "K": k, "floor_us": floor, "us": {}}
            for cfg in CONFIGS:
                calls = [partial(small_m.small_m_linear, x, w.tensors["qdata"], w.tensors["block_scale"], n, cfg)
                         for w in ws]  # fmt: skip
                row["us"][f"rt{cfg['RT']}-st{cfg['ST']}"] = time_cuda(calls)
            rows.append(row)
            print(n, k, {c: f"{floor / us:.0%}" for c, us in row["us"].items()}, flush=True)
            del ws
            torch.cuda.empty_cache()
    print("\n| N | K | CTAs (rt1) | floor us | " + " | ".join(rows[0]["us"]) + " |")
    print("|---|---|---|---|" + "---|" * len(rows[0]["us"]))
    for r in rows:
        cells = " | ".join(f"{us:.1f} ({r['floor_us'] / us:.0%})" for us in r["us"].values())
        print(f"| {r['N']} | {r['K']} | {r['N'] // 16} | {r['floor_us']:.1f} | {cells} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
