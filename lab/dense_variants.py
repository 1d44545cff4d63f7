"""The dense FP8 kernel's tokens-as-M configs (``kernels/csrc/fp8_gemm.cu``) built from the tree's sources beside
copies with lab/patches applied (``h200_pending.sh dense-variants`` makes them), at mid-M sizes of the Llama-3-8B
projections, as hybrid_sm90 plans them (one ctypes call: quantizer + GEMM; graph replay): each config's time in each
build, the tree's timed again after the copies, and whether each copy's output has the tree's bits.

Run on the device: PYTHONPATH=src python3 lab/dense_variants.py tree=src/mxgemm/kernels/csrc NAME=CSRC ... --json F
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from lt_algos import SHAPES, cases  # beside this script

from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.fp8_gemm import STAGES, TokensAsM
from mxgemm.timing import time_cuda


def use(csrc: Path) -> None:
    """Plans made from here on launch the kernels built from ``csrc/fp8_gemm.cu`` (a plan keeps the library it was
    made with)."""
    fp8_gemm._SOURCE = csrc / "fp8_gemm.cu"
    fp8_gemm.library.cache_clear()


def configs(kp: int) -> list[TokensAsM]:
    return [
        c
        for c in (TokensAsM(tn, wn, sp, st) for tn in (64, 128) for wn in (64, 128) for sp in (1, 2) for st in STAGES)
        if c.valid(kp)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("builds", nargs="+", help="NAME=CSRC, the first the reference (tree=src/mxgemm/kernels/csrc)")
    ap.add_argument("--m", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    builds = {name: Path(path) for name, path in (b.split("=", 1) for b in args.builds)}
    ref_name = next(iter(builds))
    rows = []
    for shape, n, k, m, w, x in cases(args.m, args.shapes):
        qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
        for cfg in configs(qd.shape[1]):
            plans = {}
            for name, csrc in builds.items():
                use(csrc)
                plans[name] = fp8_gemm.linear_plan(qd, bs, n, k, m, cfg)
            ref = plans[ref_name](x, None)
            row = {"shape": shape, "n": n, "k": k, "m": m, "config": repr(cfg), "us": {}, "same_bits": {}}
            for name, plan in plans.items():
                row["us"][name] = time_cuda([partial(plan, x, None)])
                row["same_bits"][name] = torch.equal(plan(x, None), ref)
            row["us"][f"{ref_name} again"] = time_cuda([partial(plans[ref_name], x, None)])
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    names = list(builds)[1:]
    head = [f"best {ref_name} µs (again)", "config", *[f"best {v} µs | config" for v in names]]
    head += [f"{v} / {ref_name}, best (each config's, min-max)" for v in names]
    print("\n| shape | M | " + " | ".join(head) + " | all bits equal |")
    print("|---|---|---|---|" + "---|---|" * len(names) + "---|" * len(names) + "---|")
    for shape in args.shapes:
        for m in args.m:
            cells = [r for r in rows if r["shape"] == shape and r["m"] == m]
            if not cells:
                continue
            best = {v: min(cells, key=lambda r: r["us"][v]) for v in builds}
            ref = best[ref_name]
            again = ref["us"][f"{ref_name} again"]
            line = f"| {shape} | {m} | {ref['us'][ref_name]:.1f} ({again:.1f}) | {ref['config']} |"
            line += "".join(f" {best[v]['us'][v]:.1f} | {best[v]['config']} |" for v in names)
            for v in names:
                each = [r["us"][v] / r["us"][ref_name] for r in cells]
                line += f" {best[v]['us'][v] / ref['us'][ref_name]:.3f} ({min(each):.2f}-{max(each):.2f}) |"
            print(line + f" {all(all(r['same_bits'].values()) for r in cells)} |")


if __name__ == "__main__":
    main()
