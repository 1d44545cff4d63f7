"""Measure the M at which quantize + cuBLASLt blockwise beats the Triton kernel on the same re-encoded weight.

Run on the device: PYTHONPATH=src python3 bench/crossover.py  (writes $OUT/crossover.json, prints a table).
"""

from __future__ import annotations

import json
import os

import torch

import mxgemm
from mxgemm.backends.cublas_block import cublas_block_linear
from mxgemm.kernels.w8a16 import default_config, w8a16_linear
from mxgemm.timing import copies_for_cold_l2, time_cuda

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (8192, 8192), (57344, 8192)]
MS = (16, 32, 48, 64, 96, 128, 192, 256)


def main() -> None:
    rows = []
    for n, k in SHAPES:
        weights = []
        for seed in range(copies_for_cold_l2(n * k, 60 * 2**20)):
            g = torch.Generator().manual_seed(seed)
            t = mxgemm.quantize((torch.randn(n, k, generator=g) * 0.02).cuda())
            weights.append(mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90"))
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def triton_call(w, x=x, m=m, n=n, k=k):
                q = w.tensors["qdata"][:n].view(torch.uint8)
                cfg = default_config(m, n, k, block_scaled=True)
                return w8a16_linear(x, q, w.tensors["block_scale"], None, block_scaled=True, config=cfg)

            t_triton = time_cuda([lambda w=w: triton_call(w) for w in weights])
            t_cublas = time_cuda([lambda w=w, x=x: cublas_block_linear(x, w, None) for w in weights])
            rows.append(dict(N=n, K=k, M=m, triton_us=t_triton, cublas_us=t_cublas))
            print(f"N={n:6d} K={k:6d} M={m:4d}  triton {t_triton:8.1f} us  cublas {t_cublas:8.1f} us", flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "crossover.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\nfirst M where cuBLASLt wins, per shape:")
    for n, k in SHAPES:
        wins = [r["M"] for r in rows if (r["N"], r["K"]) == (n, k) and r["cublas_us"] < r["triton_us"]]
        print(f"N={n} K={k}: {min(wins) if wins else '> 256'}")


if __name__ == "__main__":
    main()
