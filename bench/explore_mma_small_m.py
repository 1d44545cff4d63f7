"""Exploration: a hand-written mma.sync kernel for small M (bench/mma_small_m.cu) against the hybrid_sm90 default
and bf16, on the llama3-8b projections. Checks each variant against an fp64 reference first (random weight bytes:
every finite E4M3 code, subnormals included), then times the correct ones (graph replay, weights rotated beyond
3x L2, median), and prints a table.

Run on the device: PYTHONPATH=src python3 bench/explore_mma_small_m.py --json explore-mma-small-m-h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import pathlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.bench import MODELS, Problem, _mx_weights, floor_us
from mxgemm.timing import copies_for_cold_l2, time_cuda

NTS, RTS, KSLICES, DECODES = (1, 2), (1, 2, 4), (128, 256), (0, 1)


def build() -> Callable[..., None]:
    """Compile bench/mma_small_m.cu into a shared library (nvcc, no torch headers) and return a runner."""
    out = pathlib.Path(tempfile.mkdtemp()) / "libmma_small_m.so"
    src = pathlib.Path(__file__).parent / "mma_small_m.cu"
    t0 = time.time()
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
                    "-o", str(out), str(src)], check=True)  # fmt: skip
    print(f"built in {time.time() - t0:.1f} s", flush=True)
    lib = ctypes.CDLL(str(out))
    fn = lib.mma_small_m_run
    fn.restype = ctypes.c_int

    def run(w, s, x, y, ws, n, nt, rt, ks, decode, splits):
        m, k = x.shape
        ptr = ctypes.c_void_p
        err = fn(ptr(w.data_ptr()), ptr(s.data_ptr()), s.stride(0), ptr(x.data_ptr()), ptr(y.data_ptr()),
                 y.stride(0), ptr(ws.data_ptr()), m, k, n, w.shape[0], w.shape[1], nt, rt, ks, decode, splits,
                 ptr(torch.cuda.current_stream().cuda_stream))  # fmt: skip
        if err:
            raise RuntimeError(f"launch failed with cudaError {err}")

    return run


def padded(n: int, k: int, rt_max: int = 4):
    return -(-n // (16 * rt_max)) * 16 * rt_max, -(-k // 1024) * 1024


def random_problem(n, k, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    np_, kp = padded(n, k)
    w = torch.randint(0, 256, (np_, kp), generator=g, dtype=torch.uint8)
    w[(w & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    w[n:] = 0
    w[:, k:] = 0
    s = torch.exp2(torch.randint(-12, -4, (np_ // 128 + 1, kp // 128), generator=g).float())
    return w.cuda(), s.cuda()


def reference(x, w, s, n, k):
    wf = w[:n, :k].view(torch.float8_e4m3fn).double()
    sf = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k].double()
    return (x.double() @ (wf * sf).T).float()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 16])
    args = parser.parse_args()
    run = build()
    dev = mxgemm.describe_device()

    # correctness: every variant on an odd shape, random bytes (all finite codes)
    n, k = 4160, 4608
    w, s = random_problem(n, k)
    checks = {}
    for m in (1, 5, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = reference(x, w, s, n, k)
        for nt, rt, ks, d in itertools.product(NTS, RTS, KSLICES, DECODES):
            if 8 * nt < m:
                continue
            for splits in (1, 2):
                if w.shape[1] % (4 * ks * splits):
                    continue
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                ws = torch.empty(splits, m, w.shape[0], device="cuda")
                run(w, s, x, y, ws, n, nt, rt, ks, d, splits)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                checks[(nt, rt, ks, d, splits, m)] = err
    bad = {key: e for key, e in checks.items() if not e < 3e-3}
    print(f"correctness: {len(checks)} runs, worst rel err {max(checks.values()):.2e}, bad: {bad}", flush=True)

    rows = []
    for n, k, name in MODELS["llama3-8b"]:
        weights = _mx_weights(n, k, dev.torch_device, copies_for_cold_l2(n * k, dev.l2_bytes))
        hybrid = [mxgemm.prepare_weight(q, sc, backend="hybrid_sm90") for q, sc in weights]
        bf16 = [mxgemm.dequantize(mxgemm.MXTensor(q, sc), torch.bfloat16) for q, sc in weights]
        np_, kp = padded(n, k)
        mine = []
        for h in hybrid:
            q = h.tensors["qdata"].view(torch.uint8)
            wq = torch.zeros(np_, kp, dtype=torch.uint8, device="cuda")
            wq[: q.shape[0], : q.shape[1]] = q
            bs = h.tensors["block_scale"]
            sp = torch.zeros(np_ // 128 + 1, kp // 128, device="cuda")
            sp[: bs.shape[0], : bs.shape[1]] = bs
            mine.append((wq, sp))
        for m in args.m:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, bf16[0]).float()
            row = {"M": m, "N": n, "K": k, "name": name, "floor_us": floor_us(Problem(m, n, k), dev)}
            row["bf16"] = time_cuda([partial(F.linear, x, b) for b in bf16])
            row["hybrid"] = time_cuda([partial(mxgemm.linear, x, h) for h in hybrid])
            best = None
            for nt, rt, ks, d in itertools.product(NTS, RTS, KSLICES, DECODES):
                if 8 * nt < m or (nt == 2 and m <= 8):
                    continue
                for splits in (1, 2, 4, 8):
                    if kp % (4 * ks * splits):
                        continue
                    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                    ws = torch.empty(splits, m, np_, device="cuda")
                    run(*mine[0], x, y, ws, n, nt, rt, ks, d, splits)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    us = time_cuda([partial(run, *a, x, y, ws, n, nt, rt, ks, d, splits) for a in mine])
                    key = f"nt{nt}-rt{rt}-ks{ks}-d{d}-s{splits}"
                    row.setdefault("variants", {})[key] = (us, err)
                    if err < 1e-2 and (best is None or us < best[1]):
                        best = (key, us)
            row["best"], row["best_us"] = best
            rows.append(row)
            print(f"{name:8s} M={m:3d} floor {row['floor_us']:6.1f} bf16 {row['bf16']:6.1f} hybrid "
                  f"{row['hybrid']:6.1f} mma {row['best_us']:6.1f} ({row['best']})", flush=True)  # fmt: skip
        del weights, hybrid, bf16, mine
        torch.cuda.empty_cache()
    print("\n| shape | M | floor | bf16 | hybrid | mma best | x bf16 | % floor | variant |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['M']} | {r['floor_us']:.1f} | {r['bf16']:.1f} | {r['hybrid']:.1f} | "
              f"{r['best_us']:.1f} | {r['bf16'] / r['best_us']:.2f} | {100 * r['floor_us'] / r['best_us']:.0f} | "
              f"{r['best']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "checks": {str(k): v for k, v in checks.items()}, "rows": rows}, f,
                      indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
