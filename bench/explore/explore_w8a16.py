"""H200 exploration: w8a16 kernel variants vs bf16 / FP8 baselines, and the cuBLASLt blockwise API.

Run on the device: PYTHONPATH=src python3 bench/explore/explore_w8a16.py [--probe]; writes $OUT/explore.json.
``--probe`` also checks which scale layouts cuBLASLt's blockwise GEMM accepts, and times it (GEMM only) and FP8
rowwise at large M (docs/performance.md).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.kernels.w8a16 import w8a16_linear
from mxgemm.timing import copies_for_cold_l2, time_cuda

OUT = os.environ.get("OUT", ".")
DEADLINE = time.time() + float(os.environ.get("EXPLORE_SECONDS", "420"))
results: list[dict] = []


def weights(n, k, copies):
    out = []
    for i in range(copies):
        g = torch.Generator(device="cuda").manual_seed(i)
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        t = mxgemm.quantize(w)
        out.append((t.qdata.view(torch.uint8), t.scale))
    return out


def check(x, wq, ws, cfg):
    y = w8a16_linear(x, wq, ws, None, plain_scales=True, config=cfg)
    ref = (x.float() @ mxgemm.dequantize(mxgemm.MXTensor(wq.view(torch.float8_e4m3fn), ws)).T).bfloat16().float()
    err = (y.float() - ref).abs().max().item()
    return err <= 2 * 2**-7 * ref.abs().max().item(), err


def record(**kw):
    results.append(kw)
    print(json.dumps(kw), flush=True)


def floor_us(m, n, k):
    return max((n * k * 33 / 32 + 2 * m * k + 2 * m * n) / 4.26e12, 2 * m * n * k / 1288e12) * 1e6


def time_variants(m, n, k, cfgs, label):
    ws_list = weights(n, k, copies_for_cold_l2(n * k, 60 * 2**20))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    best = None
    for cfg in cfgs:
        if time.time() > DEADLINE:
            print("deadline reached; stopping sweep", flush=True)
            break
        try:
            ok, err = check(x, *ws_list[0], cfg)
            us = time_cuda(
                [lambda w=w, c=cfg: w8a16_linear(x, w[0], w[1], None, plain_scales=True, config=c) for w in ws_list]
            )
        except Exception as exc:  # a config that fails to compile or launch is recorded, not fatal
            record(label=label, M=m, N=n, K=k, cfg=cfg, error=str(exc)[:200])
            continue
        record(label=label, M=m, N=n, K=k, cfg=cfg, us=us, ok=ok, err=err, floor=floor_us(m, n, k))
        if ok and (best is None or us < best[0]):
            best = (us, cfg)
    return best


def time_bf16(m, n, k):
    copies = copies_for_cold_l2(2 * n * k, 60 * 2**20)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return time_cuda([lambda w=w: F.linear(x, w) for w in ws])


def probe_scaled_mm():
    """Which scale layouts cuBLASLt's 1x128 x 128x128 path accepts and computes right, on which shapes."""
    from mxgemm.block128 import dequantize_1x128, quantize_1x128, reencode_block128

    for m, n, k in [(1, 256, 256), (3, 256, 256), (4, 256, 256), (16, 130, 256), (16, 144, 256), (16, 256, 96),
                    (16, 256, 4160), (130, 4096, 4096), (256, 4096, 4096)]:  # fmt: skip
        t = mxgemm.quantize(torch.randn(n, k, device="cuda") * 0.02)
        b = reencode_block128(t.qdata, t.scale)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_1x128(x)
        ref = dequantize_1x128(xq, xs) @ b.dequantize().T
        kb = xs.shape[1]
        for variant in ("plain", "padded"):
            if variant == "plain":
                a, sa, sb = xq, xs.t().contiguous().t(), b.scale.t()
            else:  # M to a multiple of 4; both scales stored with K-block leading dims padded to a multiple of 4
                mp = m + (-m % 4)
                a = F.pad(xq.view(torch.uint8), (0, 0, 0, mp - m)).view(torch.float8_e4m3fn)
                sa = F.pad(xs, (0, -kb % 4, 0, mp - m)).t().contiguous().t()[:, :kb]
                sb = F.pad(b.scale, (0, -kb % 4)).t()[:kb]
            try:
                y = torch._scaled_mm(a, b.qdata.t(), sa, sb, out_dtype=torch.bfloat16)[:m]
                rel = ((y.float() - ref).norm() / ref.norm()).item()
                record(label="scaled_mm_probe", variant=variant, M=m, N=n, K=k, ok=rel < 0.01, rel=rel)
            except Exception as exc:
                record(label="scaled_mm_probe", variant=variant, M=m, N=n, K=k, ok=False, error=str(exc)[:160])


def time_scaled_mm(m, n, k):
    from mxgemm.block128 import quantize_1x128, reencode_block128

    copies = copies_for_cold_l2(n * k, 60 * 2**20)
    bs = []
    for _ in range(copies):
        t = mxgemm.quantize(torch.randn(n, k, device="cuda") * 0.02)
        b = reencode_block128(t.qdata, t.scale)
        bs.append((b.qdata, b.scale.t()))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_1x128(x)
    xs = xs.t().contiguous().t()
    gemm_only = time_cuda([lambda b=b: torch._scaled_mm(xq, b[0].t(), xs, b[1], out_dtype=torch.bfloat16) for b in bs])
    # rowwise FP8 ceiling (no MX semantics)
    wr = [(b[0], torch.ones(1, n, device="cuda")) for b in bs]
    xr = torch.ones(m, 1, device="cuda")
    rowwise = time_cuda([lambda b=b: torch._scaled_mm(xq, b[0].t(), xr, b[1], out_dtype=torch.bfloat16) for b in wr])
    return gemm_only, rowwise


def main():
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if "--probe" in sys.argv:
        probe_scaled_mm()
        for m, n, k in [(256, 28672, 4096), (4096, 28672, 4096), (4096, 4096, 14336)]:
            blk, row = time_scaled_mm(m, n, k)
            record(label="scaled_mm_block", M=m, N=n, K=k, us=blk)
            record(label="scaled_mm_rowwise", M=m, N=n, K=k, us=row)
    small = [(1, 28672, 4096), (4, 28672, 4096), (16, 28672, 4096), (1, 4096, 14336), (16, 4096, 14336)]
    for m, n, k in small:
        record(label="bf16", M=m, N=n, K=k, us=time_bf16(m, n, k), floor=floor_us(m, n, k))
    for m, n, k in small:

        def split_for(bn, n=n):
            return max(1, min(8, 4096 // (n // bn))) if n <= 8192 else 1

        cfgs = [
            dict(BN=bn, BM=16, BK=bk, SPLIT_K=split_for(bn), PACKED=packed, num_warps=4, num_stages=st)
            for packed, bn, bk, st in itertools.product((False, True), (32, 64), (128, 256), (3,))
        ]
        best = time_variants(m, n, k, cfgs, "small_sweep")
        record(label="small_best", M=m, N=n, K=k, best=best)
    with open(os.path.join(OUT, "explore.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\nsummary")
    for r in results:
        if r["label"] in ("bf16", "small_best"):
            print(r["label"], r["M"], r["N"], r["K"], r.get("us") or r.get("best") or r.get("error"))
    ranked = sorted((r for r in results if r.get("us") and r["label"] == "small_sweep"), key=lambda r: r["us"])
    for shape in small:
        top = [r for r in ranked if (r["M"], r["N"], r["K"]) == shape][:4]
        for r in top:
            print("top", shape, round(r["us"], 1), r["cfg"])


if __name__ == "__main__":
    main()
