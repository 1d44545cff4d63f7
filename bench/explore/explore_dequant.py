"""Exploration: the exact `triton` backend's two paths around their crossover, the w8a16 kernel (default config) and
dequantize + cuBLAS (`kernels/dequant.py`), against bf16 cuBLAS, on the llama3-8b projections at M = 32-512.
Timed as the benchmark times (graph replay, weights rotated beyond 3x L2, median). Prints a table.

Run on the device: PYTHONPATH=src python3 bench/explore/explore_dequant.py --json explore-dequant-h200.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.bench import MODELS, _mx_weights
from mxgemm.kernels.w8a16 import default_config
from mxgemm.timing import copies_for_cold_l2, time_cuda


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--m", type=int, nargs="+", default=[32, 64, 128, 256, 512])
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    b = mxgemm.backends.get_backend("triton")
    rows = []
    for n, k, name in MODELS["llama3-8b"]:
        mx = _mx_weights(n, k, dev.torch_device, copies_for_cold_l2(n * k, dev.l2_bytes))
        ws = [mxgemm.prepare_weight(q, s, backend="triton") for q, s in mx]
        bf16 = [mxgemm.dequantize(mxgemm.MXTensor(q, s), torch.bfloat16) for q, s in mx]
        del mx
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = default_config(m, n, k, packed_decode=ws[0].info["packed_decode"])
            row = {"name": name, "M": m, "N": n, "K": k, "bf16": time_cuda([partial(F.linear, x, w) for w in bf16])}
            for path, tactic in (("kernel", cfg), ("dequant", {"path": "dequant"})):
                row[path] = time_cuda([partial(b.run, x, w, None, tactic=tactic) for w in ws])
            rows.append(row)
            print(f"{name:8s} M={m:4d} bf16 {row['bf16']:7.1f} kernel {row['kernel']:7.1f} dequant "
                  f"{row['dequant']:7.1f}", flush=True)  # fmt: skip
        del ws, bf16
        torch.cuda.empty_cache()
    print("\n| shape | M | bf16 µs | kernel µs | dequant µs | dequant x bf16 | faster |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        faster = "dequant" if r["dequant"] < r["kernel"] else "kernel"
        print(f"| {r['name']} | {r['M']} | {r['bf16']:.1f} | {r['kernel']:.1f} | {r['dequant']:.1f} | "
              f"{r['bf16'] / r['dequant']:.2f} | {faster} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
