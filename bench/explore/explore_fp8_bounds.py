"""Exploration: what bounds the FP8 TMA/wgmma kernel where it is furthest from the floor (docs/performance.md
next steps): small and mid weights at M = 64 (8B qkv / o / down, 70B and 7168 qkv, 7168 o; 70B down as the control
that reaches 84%) and the 51M-84M weights at M = 16; with ``--m 256`` the M = 256 misses, where cuBLASLt runs (item
22), in the config ``--config`` names.

The GEMM alone (activations quantized beforehand, no PDL) in its default config, as built and in variants with one
part of the work taken out (patched copies of the source, built apart; their outputs are wrong by design, only their
times count):
  no-mma     the consumers wait for each stage and free it without multiplying: the ring and the epilogue alone
  no-act     the producer loads only the weight tiles (no activation tile): half the bytes per stage at M = 64
  no-reduce  no cluster sum of the K splits (every rank writes its own partial)
  ring-only  no-mma and no-act: the weight stream through the ring, nothing else
  pre-lean   the K loop before item 23 made it leaner: the same numerics, its outputs compared bit for bit
Reading: no-mma close to as built says the consumers are not the bound; no-act much faster says the activation tile
(read by every row tile from L2) is, and multicasting it over a cluster of row tiles would pay; ring-only against the
floor is the most the ring can stream with this many CTAs.

Run on the device: cd bench && PYTHONPATH=../src python3 explore_fp8_bounds.py [--m 64 16] [--config KEY]
[--variants ...] [--json ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
from explore_fp8_gemm import config_from_key
from explore_small_m_pipeline import cold_weights

import mxgemm
from mxgemm.bench import MODELS, Problem, floor_us
from mxgemm.kernels import fp8_gemm, nvcc
from mxgemm.kernels.act_quant import quantize_1x128_padded
from mxgemm.timing import SETTLE_MS, time_cuda

NO_MMA = [("ks < BK / 32; ++ks) wgmma<TN>", "ks < 0; ++ks) wgmma<TN>")]
# the patches name the swap-AB kernel's lines (with the line after, where the tokens-as-M kernel has the same one)
_RW_LOOP = "\n        for (int r = 0; r < RW;"
_K_RW_LOOP = "\n        const int k = (kb0 + it) * BK;" + _RW_LOOP
_SWAP_STEPS = "\n      wgmma_fence();\n#pragma unroll\n      for (int ks = 0; ks < BK / 32; ++ks) wgmma<TN>"
NO_ACT = [
    ("mbar_expect_tx(&full[it], STAGE + xs_bytes);" + _RW_LOOP, "mbar_expect_tx(&full[it], WB + xs_bytes);" + _RW_LOOP),
    (
        "mbar_expect_tx(&full[s], STAGE + xs_bytes);" + _K_RW_LOOP,
        "mbar_expect_tx(&full[s], WB + xs_bytes);" + _K_RW_LOOP,
    ),
    ("tma_load(smem + it * STAGE + WB, &xmap, (kb0 + it) * BK, tok0, &full[it]);", ""),
    ("tma_load(smem + s * STAGE + WB, &xmap, k, tok0, &full[s]);", ""),
]
NO_REDUCE = [("if (gridDim.y == 1) return true;", "return true;")]
# the K loop as it was before item 23's lean loop (descriptors rebuilt per step, generic loads of the scales, the
# token scales masked past Mp): the same numerics, so its outputs must equal the build's bit for bit
PRE_LEAN = [
    ("""    const int valid = a.Mp - tok0;
    if (valid < TN)
      for (int i = tid; i < ST * TN; i += NC)
        if (i % TN >= valid) xsc[i] = 0.f;
""", ""),
    ("const uint64_t off = (uint64_t)(s * (STAGE / 16));" + _SWAP_STEPS,
     "const uint32_t base = smem_u32(smem + s * STAGE);" + _SWAP_STEPS),
    ("wgmma<TN>(blk, dw0 + off + 2 * ks, dx0 + off + 2 * ks, ks);",
     "wgmma<TN>(blk, desc_sw128(base + r * ROWS * BK + 32 * ks), desc_sw128(base + WB + 32 * ks), ks);"),
    ("const float sw = lds(wsc + r * a.kblocks + it);", "const float sw = wsc[r * a.kblocks + it];"),
    ("""        const float2 x = lds2(xsc + s * TN + 8 * j + 2 * t);  // an even slot
        tsc[j][0] = x.x * sw;
        tsc[j][1] = x.y * sw;""", """        const int m = 8 * j + 2 * t;
        tsc[j][0] = tok0 + m < a.Mp ? xsc[s * TN + m] * sw : 0.f;
        tsc[j][1] = tok0 + m < a.Mp ? xsc[s * TN + m + 1] * sw : 0.f;"""),
]  # fmt: skip
VARIANTS = {"no-mma": NO_MMA, "no-act": NO_ACT, "no-reduce": NO_REDUCE, "ring-only": NO_MMA + NO_ACT,
            "pre-lean": PRE_LEAN}  # fmt: skip
SAME_NUMERICS = {"pre-lean"}  # variants whose outputs are compared with the build's
# (model, projection) rows: at M = 64 the misses and a control, at M = 16 the 51M-84M weights
ROWS = {64: [("llama3-8b", "qkv"), ("llama3-8b", "o"), ("llama3-8b", "down"), ("llama3-70b", "qkv"),
             ("hidden-7168", "qkv"), ("hidden-7168", "o"), ("llama3-70b", "down")],
        16: [("llama3-70b", "o"), ("hidden-7168", "o"), ("llama3-8b", "down")],
        256: [("llama3-8b", "qkv"), ("llama3-8b", "o"), ("llama3-8b", "down"), ("llama3-70b", "qkv"),
              ("hidden-7168", "qkv")]}  # fmt: skip


def patched_library(name: str, replacements: list[tuple[str, str]], capability: tuple[int, int]):
    """The FP8 kernel's source with each (old, new) replaced (each old must occur once), built apart and loaded."""
    src = fp8_gemm._SOURCE.read_text()
    for old, new in replacements:
        if src.count(old) != 1:
            raise ValueError(f"variant {name}: {old!r} occurs {src.count(old)} times in {fp8_gemm._SOURCE.name}")
        src = src.replace(old, new)
    path = Path(tempfile.mkdtemp()) / f"fp8_gemm_{name.replace('-', '_')}.cu"
    path.write_text(src)
    lib = nvcc.build(path, capability, suffix="a")
    lib.mxgemm_fp8_gemm.restype = fp8_gemm.library(capability).mxgemm_fp8_gemm.restype
    return lib


def problems(dev, ms=(64, 16)):
    """Each of ``ROWS[m]`` (m in ``ms``) as (row, weights, xq, xs): the row's record begun (model, name, M, N, K,
    floor_us), enough random hybrid_sm90 weights to rotate beyond 3x the L2, and random activations quantized per
    1x128. The weights are given back to the driver before the next row's are made."""
    shapes = {(model, proj): (n, k) for model, projs in MODELS.items() for n, k, proj in projs}
    for m in ms:
        for model, proj in ROWS[m]:
            n, k = shapes[(model, proj)]
            ws, _ = cold_weights(n, k, dev.l2_bytes, bf16=False)
            xq, xs = quantize_1x128_padded(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            row = {"model": model, "name": proj, "M": m, "N": n, "K": k, "floor_us": floor_us(Problem(m, n, k), dev)}
            yield row, ws, xq, xs
            ws.clear()  # the caller's name for the list is still bound: empty it so that the cache can free them
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[64, 16], choices=sorted(ROWS))
    parser.add_argument("--config", help="a config key (tn128-rw2-s2-st4) instead of each row's default config")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    cap = torch.cuda.get_device_capability()
    built = fp8_gemm.library(cap)
    names = args.variants
    with ThreadPoolExecutor(len(names)) as pool:  # nvcc runs in parallel, one variant each
        patched = dict(zip(names, pool.map(lambda v: patched_library(v, VARIANTS[v], cap), names), strict=True))
    libs = {"as built": built} | patched
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for row, ws, xq, xs in problems(dev, args.m):
        m, n = row["M"], row["N"]
        np_, kp = ws[0].tensors["qdata"].shape
        cfg = config_from_key(args.config) if args.config else fp8_gemm.default_config(m, np_, kp, sms)
        if "WN" in cfg and len(libs) > 1:
            raise SystemExit(f"M = {m}: the variants patch the swap-AB kernel; pass a --config without wnN")
        row |= {"config": cfg, "us": {}, "equal": {}}
        outputs = {}
        for variant, lib in libs.items():
            fp8_gemm.library = lambda _cap, lib=lib: lib
            calls = [partial(fp8_gemm.fp8_gemm, xq, xs, m, w.tensors["qdata"], w.tensors["block_scale"], n, cfg,
                             False) for w in ws]  # fmt: skip
            if variant == "as built" or variant in SAME_NUMERICS:
                outputs[variant] = calls[0]()
            row["us"][variant] = time_cuda(calls, warmup_ms=SETTLE_MS)
        for variant in SAME_NUMERICS & outputs.keys():
            row["equal"][variant] = bool(torch.equal(outputs[variant], outputs["as built"]))
        fp8_gemm.library = lambda _cap: built
        rows.append(row)
        cells = " ".join(f"{v} {t:6.1f}" for v, t in row["us"].items())
        same = "".join(f" {v} {'bitwise equal' if eq else 'DIFFERS'}" for v, eq in row["equal"].items())
        print(f"{row['model']} {row['name']} M={m} floor {row['floor_us']:.1f} {cfg}: {cells}{same}", flush=True)
    print("\n| model | shape | M | floor | " + " | ".join(libs) + " | % floor as built |")
    print("|---|---|---|---|" + "---|" * (len(libs) + 1))
    for r in rows:
        cells = " | ".join(f"{r['us'][v]:.1f}" for v in libs)
        print(f"| {r['model']} | {r['name']} | {r['M']} | {r['floor_us']:.1f} | {cells} | "
              f"{100 * r['floor_us'] / r['us']['as built']:.0f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
