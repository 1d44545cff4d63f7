"""Where an eager call's host time goes: each piece of the hybrid_sm90 call path timed alone, back to back (calls per
second of the host, one synchronize per round), beside bf16 ``F.linear``, on the 4096 x 4096 projection.

Run on the device: PYTHONPATH=src python3 bench/explore/eager_cost.py --json eager-cost.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.kernels import fp8_gemm, small_m


def per_call_us(fn, calls: int = 300, repeats: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def pieces_for(m: int, k: int, n: int, w, layer, dense, cap) -> dict:
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    lib, slib = fp8_gemm.library(cap), small_m.library(cap)
    libc = ctypes.CDLL(None)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    mp = -(-m // 64) * 64
    xq = torch.empty(mp * k, dtype=torch.uint8, device="cuda")
    xs = torch.empty(mp * k // 128, dtype=torch.float32, device="cuda")
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    cfg = fp8_gemm.default_config(max(m, 33), n, k, 132)
    tokm = "WN" in cfg
    rows = cfg["WN"] if tokm else cfg["RW"]
    plan = fp8_gemm.linear_plan(qd, bs, n, k, m, cfg)

    def gemm(pdl: int):
        args = (qd.data_ptr(), bs.data_ptr(), bs.stride(0), xq.data_ptr(), xs.data_ptr(), None, y.data_ptr(), n, m,
                mp, n, n, k)  # fmt: skip
        if tokm:
            return lib.mxgemm_fp8_gemm_tokm(*args, cfg["TN"], rows, cfg["SPLITS"], cfg["ST"], pdl, stream)
        return lib.mxgemm_fp8_gemm(*args, cfg["TN"], rows, cfg.get("KC", 1), cfg["SPLITS"], cfg["ST"], pdl, stream)

    def quant(rows_padded: int):  # 3 rows: refused before any launch
        return lib.mxgemm_quant_1x128(x.data_ptr(), k, 0, m, k, xq.data_ptr(), xs.data_ptr(), rows_padded, k, stream)

    pieces = {
        "F.linear bf16": lambda: F.linear(x, dense),
        "torch.empty": lambda: torch.empty((m, n), dtype=torch.bfloat16, device=x.device),
        "x.add_(0) (one aten launch)": lambda: x.add_(0),
        "ctypes: libc abs (1 arg)": lambda: libc.abs(-3),
        "ctypes: quantizer refusing (10 args, no launch)": lambda: quant(3),
        "ctypes: quantizer launch": lambda: quant(mp),
        "ctypes: FP8 GEMM launch, no PDL": lambda: gemm(0),
        "ctypes: FP8 GEMM launch, PDL": lambda: gemm(1),
        "fp8 plan (quantizer + GEMM, one ctypes call)": lambda: plan(x, None),
        "mxgemm.linear (prepared weight)": lambda: mxgemm.linear(x, w),
        "MXFP8Linear call": lambda: layer(x),
        "MXFP8Linear call, 3-D input": lambda: layer(x.view(1, m, k)),
    }
    if m <= 16:
        small = small_m.linear_plan(qd, bs, n, m)
        pieces["small-M plan (one ctypes call)"] = lambda: small(x, None)
        pieces["ctypes: small-M launch"] = lambda: slib.mxgemm_small_m(
            qd.data_ptr(), bs.data_ptr(), bs.stride(0), x.data_ptr(), None, y.data_ptr(), n, m, k, n, n, k, 1, 1, 2,
            stream,
        )  # fmt: skip
    return pieces


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    n = k = 4096
    cap = torch.cuda.get_device_capability()
    t = mxgemm.quantize(torch.randn(n, k, device="cuda") * 0.02)
    w = mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90")
    layer = mxgemm.MXFP8Linear.from_quantized(t.qdata, t.scale)
    dense = mxgemm.dequantize(t, torch.bfloat16)
    results = {}
    with torch.inference_mode():
        for m in (1, 64):
            for name, fn in pieces_for(m, k, n, w, layer, dense, cap).items():
                results[f"M={m}: {name}"] = per_call_us(fn)
                print(f"M={m:3d}  {results[f'M={m}: {name}']:7.2f} us  {name}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
