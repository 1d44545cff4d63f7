"""Our FP8 kernel at prefill sizes (M = 512-4096) against cuBLASLt's blockwise GEMM on the Llama-3-8B projections,
both with the CUDA 1x128 quantizer, as hybrid_sm90 plans them (one ctypes call; quantizer + GEMM), under graph replay:
each tokens-as-M config's time, TFLOP/s, and its largest difference from cuBLASLt's output (relative to the output's
largest magnitude; the two order the blocks' promotion alike, so bits may match).
The run in ``results/large-m-fp8-h200.json`` also timed a persistent variant of the kernel (``persistent=True``: as
many CTAs as the SMs hold, taking the tiles in turn, token tiles fastest), in history at f55e9d0.

Run on the device: PYTHONPATH=src python3 lab/large_m_fp8.py --json large-m-fp8.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
from lt_algos import SHAPES, cases  # beside this script

from mxgemm.backends import get_backend
from mxgemm.backends.base import Tactic
from mxgemm.backends.hybrid_sm90 import Path as Route
from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.fp8_gemm import STAGES, TokensAsM
from mxgemm.timing import time_cuda


def configs(kp: int) -> list[TokensAsM]:
    """128-token tiles, one K split (two give other bits)."""
    return [c for c in (TokensAsM(128, wn, 1, st) for wn in (128, 64) for st in STAGES) if c.valid(kp)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[512, 1000, 2048, 4096])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    backend = get_backend("hybrid_sm90")
    rows = []
    for name, n, k, m, w, x in cases(args.m, args.shapes):
        qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
        lt = backend.plan(w, m, torch.bfloat16, Tactic(Route.CUBLAS))
        ref = lt(x, None).float()
        top = ref.abs().max().item()
        row = {"shape": name, "n": n, "k": k, "m": m, "cublas_us": time_cuda([partial(lt, x, None)]), "fp8": {}}
        for cfg in configs(qd.shape[1]):
            plan = fp8_gemm.linear_plan(qd, bs, n, k, m, cfg)
            y = plan(x, None).float()
            row["fp8"][repr(cfg)] = {"us": time_cuda([partial(plan, x, None)]),
                                     "same_bits": torch.equal(y, ref),
                                     "max_rel": ((y - ref).abs().max() / top).item()}  # fmt: skip
        row["cublas_again_us"] = time_cuda([partial(lt, x, None)])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print(
        "\n| shape | M | cuBLASLt µs (again) | TFLOP/s | best FP8 µs | TFLOP/s | config | FP8 / cuBLASLt | max rel | "
        "all bits as cuBLASLt's |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        flop = 2 * r["m"] * r["n"] * r["k"]
        cfg, best = min(r["fp8"].items(), key=lambda kv: kv[1]["us"])
        print(f"| {r['shape']} | {r['m']} | {r['cublas_us']:.1f} ({r['cublas_again_us']:.1f}) | "
              f"{flop / r['cublas_us'] / 1e6:.0f} | {best['us']:.1f} | {flop / best['us'] / 1e6:.0f} | {cfg} | "
              f"{best['us'] / r['cublas_us']:.3f} | {best['max_rel']:.2g} | "
              f"{all(v['same_bits'] for v in r['fp8'].values())} |")  # fmt: skip


if __name__ == "__main__":
    main()
