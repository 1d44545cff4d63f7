"""The routed block's one C call (``mxgemm_moe_experts``, the wgmma path's seven launches) built from several
source folders side by side: each folder's ``grouped_fp8.cu`` and ``moe_routing.cuh`` (with the package's
``kernels/csrc`` headers) built with nvcc, run on the same tokens, routings and prepared experts with the configs the
product picks there (its tuning file or default), timed as ``mxgemm bench --moe`` times a block (CUDA-graph replay of
8 routings), every output compared bit for bit with the first folder's.

Run on the device: PYTHONPATH=src python3 lab/block_variants.py tree=src/mxgemm/kernels/grouped/csrc NAME=FOLDER
    [--tokens 1 16 256 2048 4096] --json OUT
(``h200_pending.sh block-variants`` makes a folder for each of ``lab/patches``' BLOCK_PATCHES, applied to a copy of
the kernels.)
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

import mxgemm
from mxgemm import autotune
from mxgemm.backends import get_backend
from mxgemm.bench_moe import MOE_MODELS, random_experts, top_k_routing
from mxgemm.kernels.grouped import wgmma
from mxgemm.timing import time_cuda


def run(lib, plan, x, ids, w, gate_up, down):
    """``plan`` (an ExpertsLaunch) through ``lib`` instead of the package's library."""
    package = wgmma.library
    wgmma.library = lambda capability: lib
    try:
        return plan(x, ids, w, gate_up, down)
    finally:
        wgmma.library = package


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="+", help="NAME=FOLDER")
    parser.add_argument("--models", nargs="+", default=list(MOE_MODELS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 256, 2048, 4096])
    parser.add_argument("--json")
    args = parser.parse_args()
    folders = dict(spec.split("=", 1) for spec in args.variants)
    libs = {name: wgmma.build(Path(folder) / "grouped_fp8.cu", (9, 0)) for name, folder in folders.items()}
    cuda, triton = torch.device("cuda"), get_backend("triton")
    out = []
    print(f"{'model':14s} {'tokens':>6s} " + " ".join(f"{v:>9s}" for v in libs) + "  same bits", flush=True)
    for model in args.models:
        e, hidden, width, topk = MOE_MODELS[model]
        gate_up = mxgemm.prepare_grouped_weight(*random_experts(e, 2 * width, hidden, seed=1, device=cuda))
        down = mxgemm.prepare_grouped_weight(*random_experts(e, hidden, width, seed=2, device=cuda))
        for t in args.tokens:
            picks = [top_k_routing(t, e, topk, seed=r, device=cuda) for r in range(8)]
            xs = [torch.randn(t, hidden, device=cuda).bfloat16() for _ in picks]
            tactics = autotune.tactics_for_experts_call(triton, gate_up, down, t, topk, xs[0])
            plan = triton.plan_experts(gate_up, down, t, topk, torch.bfloat16, tactics)
            if not isinstance(plan, wgmma.ExpertsLaunch):
                print(f"{model:14s} {t:6d} not the C call here: left out", flush=True)
                continue
            res, ref, same = {}, None, True
            for name, lib in libs.items():
                y = run(lib, plan, xs[0], *picks[0], gate_up, down)
                ref = y if ref is None else ref
                same = same and torch.equal(y, ref)
                calls = [partial(run, lib, plan, x, i, w, gate_up, down) for x, (i, w) in zip(xs, picks, strict=True)]
                res[name] = time_cuda(calls)
            print(f"{model:14s} {t:6d} " + " ".join(f"{res[v]:9.1f}" for v in libs) + f"  {same}", flush=True)
            out.append({"model": model, "tokens": t, "configs": plan.configs, "us": res, "same_bits": same})
        del gate_up, down
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": out}, indent=1))


if __name__ == "__main__":
    main()
