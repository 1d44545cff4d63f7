"""How far each hybrid_sm90 path is from the exact product of the operands it multiplies, element by element: the
worst error in units of one output ulp, and in units of sum(|x_i w_i|) past half an ulp (the summation order's
share). Backs the allowances of tests/helpers.py.

Run on the device: PYTHONPATH=src python3 lab/ulp_margins.py [--json ulp.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch

import mxgemm
from mxgemm.backends.hybrid_sm90 import HybridSM90Backend
from mxgemm.block128 import dequantize_1x128, quantize_1x128, reencode_block128


def margins(y: torch.Tensor, xe: torch.Tensor, we: torch.Tensor) -> tuple[float, float]:
    ref = xe.double() @ we.double().T
    mag = xe.double().abs() @ we.double().abs().T
    top = torch.maximum(y.double().abs(), ref.abs()).clamp_min(torch.finfo(torch.bfloat16).smallest_normal)
    ulp = torch.exp2(torch.floor(torch.log2(top)) - 7)
    err = (y.double() - ref).abs()
    order = ((err - ulp / 2).clamp_min(0) / mag).max().item()
    return (err / ulp).max().item(), math.log2(order) if order > 0 else float("-inf")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    b = HybridSM90Backend()
    rows = []
    for n, k in ((4096, 4096), (4096, 14336), (28672, 4096), (130, 96)):
        g = torch.Generator().manual_seed(n + k)
        t = mxgemm.quantize((torch.randn(n, k, generator=g) * 0.02).cuda())
        w = mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90")
        we = reencode_block128(t.qdata, t.scale).dequantize()
        for m in (1, 16, 32, 64, 256, 2048):
            x = torch.randn(m, k, generator=g).cuda().bfloat16()
            for quantized in (False, True):
                w.info["crossover"] = 1 if quantized else 2**31
                xe = dequantize_1x128(*quantize_1x128(x)) if quantized else x.float()
                first = {}
                for tactic in b.tactics(m, w):  # each path's first (default) config
                    first.setdefault(tactic.path, tactic)
                for path, tactic in first.items():
                    ulps, order = margins(b.run(x, w, None, tactic=tactic), xe, we)
                    rows.append({"n": n, "k": k, "m": m, "path": str(path), "max_ulps": ulps, "log2_order": order})
                    print(f"{n:6d} {k:6d} M={m:5d} {path:8s} worst {ulps:5.2f} ulp, sums 2^{order:6.1f}", flush=True)
    for path in sorted({r["path"] for r in rows}):
        mine = [r for r in rows if r["path"] == path]
        worst, order = max(r["max_ulps"] for r in mine), max(r["log2_order"] for r in mine)
        print(f"{path:8s} worst {worst:.2f} ulp, sums 2^{order:.1f} of sum(|x_i w_i|)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mxgemm.describe_device()), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
