"""Exploration: the FP8 TMA/wgmma kernel (`kernels/csrc/fp8_gemm.cu`) against bf16 cuBLAS, `auto` and cuBLASLt's
blockwise path (the same numerics: activations quantized per 1x128) at M = 64 and 256 (default) on the 8B / 70B /
7168-hidden projections.

Every config is first checked against the emulated twin (the quantized operands multiplied in fp64) on odd shapes,
then timed as the benchmark times (graph replay, weights rotated beyond 3x L2, median; the activation quantizer
inside the timed call). Prints a table last.

Run on the device: cd bench && PYTHONPATH=../src python3 explore_fp8_gemm.py --json explore-fp8-gemm-h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import torch.nn.functional as F
from explore_small_m_pipeline import cold_weights, hybrid, random_mx

import mxgemm
from mxgemm.backends.cublas_block import cublas_block_linear
from mxgemm.bench import MODELS, Problem, floor_us
from mxgemm.block128 import dequantize_block128
from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.act_quant import quantize_1x128_padded
from mxgemm.timing import time_cuda


def configs(m: int, kp: int, stages=(2, 4, 6)) -> list[dict]:
    out = []
    near = [t for t in fp8_gemm.TOKEN_TILES if t >= min(m, 64) / 2][:3]  # the tiles around M
    for tn, (rw, kc), splits, st in itertools.product(near, ((1, 1), (2, 1), (1, 2)), (1, 2, 4), stages):
        cfg = {"TN": tn, "RW": rw, "SPLITS": splits, "ST": st} | ({"KC": kc} if kc > 1 else {})
        if fp8_gemm.valid_config(cfg, kp):
            out.append(cfg)
    return out


def key(cfg: dict) -> str:
    """ "tn128-rw1-kc2-s1-st4" (swap-AB) or "tn128-wn64-s1-st4" (tokens as wgmma M)."""
    if "WN" in cfg:
        return f"tn{cfg['TN']}-wn{cfg['WN']}-s{cfg['SPLITS']}-st{cfg['ST']}"
    kc = f"-kc{cfg['KC']}" if cfg.get("KC", 1) > 1 else ""
    return f"tn{cfg['TN']}-rw{cfg['RW']}{kc}-s{cfg['SPLITS']}-st{cfg['ST']}"


def config_from_key(text: str) -> dict:
    """``key``'s inverse: "tn128-rw1-kc2-s1-st4" -> {"TN": 128, "RW": 1, "KC": 2, "SPLITS": 1, "ST": 4}."""
    names = {"tn": "TN", "rw": "RW", "kc": "KC", "wn": "WN", "st": "ST", "s": "SPLITS"}
    cfg = {}
    for part in text.split("-"):
        prefix = part.rstrip("0123456789")
        if prefix not in names or prefix == part:
            raise ValueError(f"{text!r}: {part!r} is not one of tnN, rwN, kcN, wnN, sN, stN")
        cfg[names[prefix]] = int(part[len(prefix) :])
    return cfg


def run(x, w, cfg, pdl=True, out=None):
    xq, xs = quantize_1x128_padded(x)
    t = w.tensors
    return fp8_gemm.fp8_gemm(xq, xs, x.shape[0], t["qdata"], t["block_scale"], w.out_features, cfg, pdl, out)


def gemm_only(xq, xs, m, w, cfg):
    t = w.tensors
    return fp8_gemm.fp8_gemm(xq, xs, m, t["qdata"], t["block_scale"], w.out_features, cfg, False)


def twin(x, w) -> torch.Tensor:
    xq, xs = quantize_1x128_padded(x)
    xf = xq.double() * xs.double().repeat_interleave(128, dim=1)
    t = w.tensors
    wf = dequantize_block128(t["qdata"], t["block_scale"]).double()
    return (xf @ wf.T)[: x.shape[0], : w.out_features]


def check(configs_for=configs, shapes=((4160, 8000), (130, 96), (4096, 4096)), ms=(1, 17, 64, 100, 256)) -> dict:
    """Every config ``configs_for(m, kp)`` gives against the emulated twin, into an output filled with NaN first."""
    errs = {}
    for n, k in shapes:
        w = hybrid(*random_mx(n, k, 0))
        kp = w.tensors["qdata"].shape[1]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = twin(x, w)
            for cfg in configs_for(m, kp):
                y = run(x, w, cfg, out=torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16))
                errs[f"{n}x{k}-m{m}-{key(cfg)}"] = ((y.double() - ref).norm() / ref.norm()).item()
    bad = {k_: e for k_, e in errs.items() if not e < 4e-3}
    print(f"correctness: {len(errs)} runs, worst rel err {max(errs.values()):.2e}, {len(bad)} bad: "
          f"{dict(list(bad.items())[:6])}", flush=True)  # fmt: skip
    return errs


def baselines(model, name, m, n, k, x, ws, bf16, dev) -> dict:
    """A row's shape, floor and the times it is compared with: bf16 cuBLAS, ``auto``, cuBLASLt's blockwise GEMM."""
    return {"model": model, "name": name, "M": m, "N": n, "K": k, "floor_us": floor_us(Problem(m, n, k), dev),
            "bf16": time_cuda([partial(F.linear, x, b) for b in bf16]),
            "auto": time_cuda([partial(mxgemm.linear, x, w) for w in ws]),
            "cublas": time_cuda([partial(cublas_block_linear, x, w, None) for w in ws])}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--m", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 6])
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    errs = check()
    if not max(errs.values()) < 4e-3:
        return
    rows = []
    for model in args.models:
        for n, k, name in MODELS[model]:
            ws, bf16 = cold_weights(n, k, dev.l2_bytes)
            kp = ws[0].tensors["qdata"].shape[1]
            for m in args.m:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                row = baselines(model, name, m, n, k, x, ws, bf16, dev) | {"us": {}}
                timed = configs(m, kp, args.stages)
                for cfg in timed:
                    row["us"][key(cfg)] = time_cuda([partial(run, x, w, cfg) for w in ws])
                row["best"] = min(row["us"].items(), key=lambda kv: kv[1])
                for fam in ("kc1", "kc2"):  # the best with one / two consumer warpgroups per row tile
                    mine = {c: t for c, t in row["us"].items() if ("-kc2" in c) == (fam == "kc2")}
                    row[f"best_{fam}"] = min(mine.items(), key=lambda kv: kv[1])
                best = next(c for c in timed if key(c) == row["best"][0])
                xq, xs = quantize_1x128_padded(x)  # where the time goes: the quantizer, the GEMM, the launch overlap
                row["quant_us"] = time_cuda([partial(quantize_1x128_padded, x)] * len(ws))
                row["gemm_us"] = time_cuda([partial(gemm_only, xq, xs, m, w, best) for w in ws])
                row["no_pdl_us"] = time_cuda([partial(run, x, w, best, False) for w in ws])
                rows.append(row)
                print(f"{model} {name:8s} M={m:3d} floor {row['floor_us']:6.1f} bf16 {row['bf16']:6.1f} auto "
                      f"{row['auto']:6.1f} cublas {row['cublas']:6.1f} fp8 {row['best'][1]:6.1f} ({row['best'][0]}) "
                      f"kc1 {row['best_kc1'][1]:6.1f} kc2 {row['best_kc2'][1]:6.1f} "
                      f"quant {row['quant_us']:5.1f} gemm {row['gemm_us']:6.1f} no-pdl {row['no_pdl_us']:6.1f}",
                      flush=True)  # fmt: skip
            del ws, bf16
            torch.cuda.empty_cache()
    print(
        "\n| model | shape | M | floor | bf16 | auto | cuBLASLt | fp8 best | x bf16 | x auto | config | KC 1 | KC 2 "
        "| quant | gemm | no PDL |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cfg, us = r["best"]
        print(f"| {r['model']} | {r['name']} | {r['M']} | {r['floor_us']:.1f} | {r['bf16']:.1f} | {r['auto']:.1f} | "
              f"{r['cublas']:.1f} | {us:.1f} | {r['bf16'] / us:.2f} | {r['auto'] / us:.2f} | {cfg} | "
              f"{r['best_kc1'][1]:.1f} | {r['best_kc2'][1]:.1f} | "
              f"{r['quant_us']:.1f} | {r['gemm_us']:.1f} | {r['no_pdl_us']:.1f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "checks": errs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
