"""Grouped GEMMs of mixture-of-experts projections on the GPU: mxgemm's grouped call (activation quantization
included) against bf16 ``torch._grouped_mm`` and FP8 rowwise ``torch._scaled_grouped_mm`` (GEMM only, activations
pre-quantized), and the floor: the active experts' FP8 and scale bytes over the copy bandwidth (measured first: a
1 GiB device-to-device copy, bytes read plus written).

Each time is a CUDA-graph replay of several routings of the same token count (uniform top-k, a new draw each), so
that the active experts change from call to call and their weights do not stay in L2.

Run on the device: PYTHONPATH=src python3 bench/moe.py --json moe.json --markdown moe.md
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

import mxgemm
from mxgemm.timing import time_cuda

# (experts, hidden, expert width, top-k)
MODELS = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
ROUTINGS = 8


def _experts(e: int, n: int, k: int, seed: int):
    """Random MX experts [E, N, K] and their bf16 values, made one expert at a time on the GPU."""
    q = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty((e, n, k // 32), dtype=torch.uint8, device="cuda")
    w = torch.empty((e, n, k), dtype=torch.bfloat16, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for i in range(e):
        t = mxgemm.quantize(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        q[i], s[i], w[i] = t.qdata, t.scale, mxgemm.dequantize(t).to(torch.bfloat16)
    return q, s, w


def _routing(tokens: int, e: int, topk: int, seed: int) -> tuple[torch.Tensor, int]:
    """int32 cumulative row ends of a uniform top-k routing, and how many experts it makes active."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, e, generator=g).topk(topk, dim=1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=e)
    return counts.cumsum(0).to(torch.int32).cuda(), int((counts > 0).sum())


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, read plus written."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (time_cuda([partial(dst.copy_, src)]) * 1e-6)


def _rowwise(x: torch.Tensor):
    amax = x.float().abs().amax(dim=1).clamp_min(1e-12)
    return (x.float() * (448.0 / amax)[:, None]).to(torch.float8_e4m3fn), amax / 448.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    rows = []
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for model in args.models:
        e, hidden, width, topk = MODELS[model]
        for proj, (n, k) in (("gate_up", (2 * width, hidden)), ("down", (hidden, width))):
            q, s, w16 = _experts(e, n, k, seed=n + k)
            prepared = mxgemm.prepare_grouped_weight(q, s)
            del q, s
            w16_t = w16.transpose(1, 2)  # [E, K, N] as _grouped_mm takes it
            w8 = w16.to(torch.float8_e4m3fn).transpose(1, 2)
            w8_scale = torch.ones(e, n, device="cuda")
            for tokens in args.tokens:
                rows_n = tokens * topk
                routings = [_routing(tokens, e, topk, seed=r) for r in range(ROUTINGS)]
                xs = [torch.randn(rows_n, k, device="cuda").bfloat16() for _ in routings]
                offs = [off for off, _ in routings]
                ours = [partial(mxgemm.grouped_linear, x, prepared, o) for x, o in zip(xs, offs, strict=True)]
                bf16 = [partial(torch._grouped_mm, x, w16_t, offs=o) for x, o in zip(xs, offs, strict=True)]
                y, ref = ours[0](), bf16[0]()
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                us = {"mxgemm": time_cuda(ours, warmup_ms=50), "bf16": time_cuda(bf16)}
                try:
                    quantized = [_rowwise(x) for x in xs]
                    fp8 = [
                        partial(torch._scaled_grouped_mm, xq, w8, xsc, w8_scale, offs=off, out_dtype=torch.bfloat16)
                        for (xq, xsc), off in zip(quantized, offs, strict=True)
                    ]
                    us["fp8_rowwise"] = time_cuda(fp8)
                except (RuntimeError, TypeError) as exc:
                    us["fp8_rowwise"] = None
                    print(f"  _scaled_grouped_mm: {str(exc).splitlines()[0]}")
                active = sum(a for _, a in routings) / len(routings)
                floor = active * n * k * (1 + 4 / 128**2) / bandwidth * 1e6
                row = dict(model=model, proj=proj, E=e, N=n, K=k, tokens=tokens, rows=rows_n, active=active)
                row.update(floor_us=floor, us=us, rel_err_vs_bf16=err)
                rows.append(row)
                fp8_us = f"{us['fp8_rowwise']:8.1f}" if us["fp8_rowwise"] else "       -"
                ours_us = us["mxgemm"]
                print(
                    f"{model:14s} {proj:7s} T={tokens:5d} active={active:5.1f} floor {floor:8.1f}  ours {ours_us:8.1f}"
                    f" ({ours_us / floor:5.2f}x floor)  bf16 {us['bf16']:8.1f} ({us['bf16'] / ours_us:5.2f}x)"
                    f"  fp8 rowwise {fp8_us}  err {err:.2e}",
                    flush=True,
                )
            del prepared, w16, w16_t, w8
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name()
    if args.json:
        with open(args.json, "w") as f:
            meta = {"device": device, "torch": torch.__version__, "copy_bytes_per_s": bandwidth}
            json.dump({**meta, "rows": rows}, f, indent=1)
    if args.markdown:
        columns = ["model", "proj", "tokens", "active experts", "floor", "mxgemm", "bf16 _grouped_mm"]
        columns += ["FP8 rowwise (GEMM only)", "mxgemm / floor", "bf16 / mxgemm"]
        copy = f"copy {bandwidth / 1e12:.2f} TB/s"
        lines = [f"Grouped GEMM, CUDA-graph replay of {ROUTINGS} routings, {device} ({copy}); µs per call", ""]
        lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for r in rows:
            u = r["us"]
            fp8 = f"{u['fp8_rowwise']:.1f}" if u["fp8_rowwise"] else "-"
            cells = [r["model"], r["proj"], r["tokens"], f"{r['active']:.1f}", f"{r['floor_us']:.1f}"]
            cells += [f"{u['mxgemm']:.1f}", f"{u['bf16']:.1f}", fp8, f"{u['mxgemm'] / r['floor_us']:.2f}"]
            cells.append(f"{u['bf16'] / u['mxgemm']:.2f}")
            lines.append("| " + " | ".join(map(str, cells)) + " |")
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
