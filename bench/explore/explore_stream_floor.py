"""Exploration: the fixed cost of one call against the bytes it streams, for the M = 64 misses on small weights
(docs/performance.md). explore_fp8_bounds.py found that the FP8 kernel's weight stream alone (`ring-only`) is
most of its time there; this script says how much of that is a cost any kernel pays per call in this harness and how
much is the kernel's own.

On the 8B-width weight (N = 4096) at K = 1024 ... 28672 (4-117 MB), timed as the benchmark times (graph replay,
operands rotated beyond 3x L2, median, 100 ms settle):
  empty        a Triton kernel of 128 programs that each store one word: the launch in a graph, nothing read
  read         the best of a few Triton kernels that only read the N*K weight bytes (16-64 KiB per program)
  bf16 M=1     cuBLAS bf16 GEMV over a [N/2, K] bf16 weight: the same bytes
  fp8 ...      the FP8 kernel at M = 64 in its default config (activations quantized beforehand): as built, its
               `ring-only` build (explore_fp8_bounds.py), and as built with the tensor maps prefetched at entry
For each, a least-squares line time = fixed + bytes / rate over the sizes: `fixed` is what a call costs beyond its
bytes at that rate.

Run on the device: cd bench && PYTHONPATH=../src python3 explore_stream_floor.py [--json ...]
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from explore_fp8_bounds import NO_ACT, NO_MMA, patched_library
from explore_small_m_pipeline import cold_weights

import mxgemm
from mxgemm.bench import FLOOR_CEILINGS
from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.act_quant import quantize_1x128_padded
from mxgemm.timing import SETTLE_MS, copies_for_cold_l2, time_cuda

N, M = 4096, 64
KS = [1024, 2048, 4096, 8192, 14336, 28672]
PREFETCH = [("  if (tid == 0) {\n    for (int s = 0; s < ST; ++s)",
             "  if (tid == 128 * RW) {  // the producer warp: tensor maps into the descriptor cache\n"
             '    asm volatile("prefetch.tensormap [%0];" ::"l"(&wmap) : "memory");\n'
             '    asm volatile("prefetch.tensormap [%0];" ::"l"(&xmap) : "memory");\n'
             "  }\n  if (tid == 0) {\n    for (int s = 0; s < ST; ++s)")]  # fmt: skip
READ_CONFIGS = [(4096, 4), (8192, 8), (16384, 8)]  # (int32 words per program, warps)


@triton.jit
def _empty(out):
    tl.store(out + tl.program_id(0), 1)


@triton.jit
def _read(src, out, n_words, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + tl.program_id(0), tl.max(tl.load(src + offs, mask=offs < n_words, other=0)))


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares time_us = fixed + bytes / rate: (fixed µs, rate TB/s)."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    slope = sum((b - mx) * (t - my) for b, t in points) / sum((b - mx) ** 2 for b, _ in points)
    return my - slope * mx, 1e-6 / slope


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    cap = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with ThreadPoolExecutor(3) as pool:  # nvcc runs in parallel
        jobs = {"fp8 as built": pool.submit(fp8_gemm.library, cap),
                "fp8 ring-only": pool.submit(patched_library, "ring-only", NO_MMA + NO_ACT, cap),
                "fp8 prefetch": pool.submit(patched_library, "prefetch", PREFETCH, cap)}  # fmt: skip
        libs = {name: job.result() for name, job in jobs.items()}
    built = libs["fp8 as built"]
    out = torch.empty(1 << 20, dtype=torch.int32, device="cuda")
    rows = []
    for k in KS:
        nbytes = N * k
        row = {"K": k, "bytes": nbytes, "floor_us": nbytes / FLOOR_CEILINGS["H200"][0] * 1e6, "us": {}}
        row["us"]["empty"] = time_cuda([partial(_empty[(128,)], out)] * 4, warmup_ms=SETTLE_MS)
        bufs = [torch.randint(-(2**31), 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
                for _ in range(copies_for_cold_l2(nbytes, dev.l2_bytes))]  # fmt: skip
        reads = {}
        for block, warps in READ_CONFIGS:
            grid = (triton.cdiv(nbytes // 4, block),)
            calls = [partial(_read[grid], b, out, nbytes // 4, BLOCK=block, num_warps=warps) for b in bufs]
            reads[f"{block}w{warps}"] = time_cuda(calls, warmup_ms=SETTLE_MS)
        best = min(reads, key=reads.get)
        row["us"]["read"], row["read_config"], row["read_all"] = reads[best], best, reads
        del bufs
        x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        dense = [torch.randn(N // 2, k, device="cuda", dtype=torch.bfloat16)
                 for _ in range(copies_for_cold_l2(nbytes, dev.l2_bytes))]  # fmt: skip
        row["us"]["bf16 M=1"] = time_cuda([partial(F.linear, x1, w) for w in dense], warmup_ms=SETTLE_MS)
        del dense
        ws, _ = cold_weights(N, k, dev.l2_bytes, bf16=False)
        np_, kp = ws[0].tensors["qdata"].shape
        cfg = fp8_gemm.default_config(M, np_, kp, sms)
        row["config"] = cfg
        xq, xs = quantize_1x128_padded(torch.randn(M, k, device="cuda", dtype=torch.bfloat16))
        for name, lib in libs.items():
            fp8_gemm.library = lambda _cap, lib=lib: lib
            calls = [partial(fp8_gemm.fp8_gemm, xq, xs, M, w.tensors["qdata"], w.tensors["block_scale"], N, cfg,
                             False) for w in ws]  # fmt: skip
            row["us"][name] = time_cuda(calls, warmup_ms=SETTLE_MS)
        fp8_gemm.library = lambda _cap: built
        del ws
        torch.cuda.empty_cache()
        rows.append(row)
        cells = " ".join(f"{n} {t:.1f}" for n, t in row["us"].items())
        print(f"K={k} {nbytes / 1e6:.1f} MB floor {row['floor_us']:.1f} {cfg}: {cells} (read: {reads})", flush=True)
    names = list(rows[0]["us"])
    fits = {n: fit([(r["bytes"], r["us"][n]) for r in rows]) for n in names if n != "empty"}
    print(f"\n| K | MB | floor | {' | '.join(names)} |")
    print("|---|---|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['K']} | {r['bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | "
              + " | ".join(f"{r['us'][n]:.1f}" for n in names) + " |")  # fmt: skip
    print("| fit: fixed µs | | | - | " + " | ".join(f"{fits[n][0]:.2f}" for n in names if n != "empty") + " |")
    print("| fit: TB/s | | | - | " + " | ".join(f"{fits[n][1]:.2f}" for n in names if n != "empty") + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "N": N, "M": M, "rows": rows,
                       "fits": {n: {"fixed_us": a, "tb_s": b} for n, (a, b) in fits.items()}}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
