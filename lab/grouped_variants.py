"""Variants of the grouped wgmma kernel's source side by side: each folder's ``grouped_fp8.cu`` (with the
``sm90.cuh`` beside it, else the one in ``../../csrc`` as in the package) built with nvcc, run on the same rows
quantized apart and timed as ``mxgemm bench --moe`` times a projection (CUDA-graph replay of 8 routings, GEMM alone);
every output compared with the problem's first (variants and configs give the same bits where they are right: the
largest relative difference is printed). A source whose entry point takes no ``persistent`` argument (before the
persistent grid) runs its own grid; a config a version does not have is left out of its column.

A folder per version (``h200_pending.sh grouped-variants`` makes one for the kernel before the persistent grid and
one for each ``lab/patches/grouped-*.patch``), e.g. the last commit's beside the tree's:
    mkdir -p /tmp/head && git show HEAD:src/mxgemm/kernels/grouped/csrc/grouped_fp8.cu > /tmp/head/grouped_fp8.cu \
      && git show HEAD:src/mxgemm/kernels/csrc/sm90.cuh > /tmp/head/sm90.cuh
Run on the device: PYTHONPATH=src python3 lab/grouped_variants.py head=DIR new=DIR [...] --json OUT
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
from functools import partial
from pathlib import Path

import torch

import mxgemm
from mxgemm.bench_moe import MOE_MODELS, random_experts, routing_offsets
from mxgemm.kernels import nvcc, raw_stream
from mxgemm.kernels.grouped.fp8 import token_tile_slots
from mxgemm.kernels.grouped.quant import quantize_rows
from mxgemm.kernels.grouped.wgmma import WgmmaConfig
from mxgemm.timing import time_cuda

# (model, projection, tokens, configs): the cells of bench --moe that moved between kernel versions, and tiles to try
PROBLEMS = [
    ("mixtral-8x7b", "down", 1, [WgmmaConfig(64, 128, 6), WgmmaConfig(64, 128, 4)]),
    ("mixtral-8x7b", "down", 4, [WgmmaConfig(64, 128, 4)]),
    ("mixtral-8x7b", "gate_up", 1024, [WgmmaConfig(128, 128, 4), WgmmaConfig(128, 128, 4, True)]),
    ("mixtral-8x7b", "down", 4096, [WgmmaConfig(128, 128, 6), WgmmaConfig(128, 128, 6, True)]),
    ("qwen3-30b-a3b", "gate_up", 4096, [WgmmaConfig(128, 128, 4), WgmmaConfig(128, 128, 4, True)]),
    ("qwen3-30b-a3b", "down", 4096, [WgmmaConfig(128, 128, 6), WgmmaConfig(128, 128, 6, True)]),
    ("qwen3-30b-a3b", "gate_up", 256, [WgmmaConfig(64, 128, 4), WgmmaConfig(64, 128, 4, True)]),
    ("qwen3-30b-a3b", "gate_up", 1024, [WgmmaConfig(64, 128, 4, True), WgmmaConfig(64, 160, 4, True)]),
    ("mixtral-8x7b", "gate_up", 256, [WgmmaConfig(64, 128, 4), WgmmaConfig(64, 160, 4)]),
    ("mixtral-8x7b", "gate_up", 4096, [WgmmaConfig(128, 128, 4), WgmmaConfig(64, 160, 4), WgmmaConfig(64, 160, 6)]),
    ("deepseek-v3", "down", 64, [WgmmaConfig(64, 128, 4), WgmmaConfig(64, 128, 4, True)]),
    ("deepseek-v3", "down", 4096, [WgmmaConfig(128, 128, 6), WgmmaConfig(128, 128, 6, True)]),
]

# --large: the prefill sizes where the wgmma kernel trails DeepGEMM contiguous, its 128-row token tiles (which
# lab/patches/grouped-mc.patch runs in CTA pairs that share the token tile) and 128 x 160 tiles (grouped-wide.patch)
WIDE = [WgmmaConfig(128, 160, 4), WgmmaConfig(128, 160, 6)]
LARGE = [
    ("qwen3-30b-a3b", "gate_up", 4096, [WgmmaConfig(128, 128, 4), WgmmaConfig(128, 128, 4, True), *WIDE]),
    ("qwen3-30b-a3b", "down", 4096, [WgmmaConfig(128, 128, 6), WgmmaConfig(128, 128, 6, True), *WIDE]),
    ("mixtral-8x7b", "gate_up", 1024, [WgmmaConfig(128, 128, 4), WgmmaConfig(128, 128, 6), *WIDE]),
    ("mixtral-8x7b", "gate_up", 4096, [WgmmaConfig(128, 128, 4), WgmmaConfig(128, 128, 6), *WIDE]),
    ("mixtral-8x7b", "down", 4096, [WgmmaConfig(128, 128, 6), WgmmaConfig(128, 128, 6, True), *WIDE]),
    ("deepseek-v3", "gate_up", 4096, [WgmmaConfig(128, 128, 4), WgmmaConfig(128, 128, 6), *WIDE]),
    ("deepseek-v3", "down", 4096, [WgmmaConfig(128, 128, 6), WgmmaConfig(128, 128, 6, True), *WIDE]),
]


def load(folder: Path) -> tuple[ctypes.CDLL, bool]:
    """The variant's library and whether its entry point takes ``persistent``."""
    source = folder / "grouped_fp8.cu"
    headers = folder.parents[1] / "csrc"  # the package's layout; a sm90.cuh beside the source comes first
    lib = nvcc.build(source, (9, 0), suffix="a", symbols=("mxgemm_grouped_fp8",), include_dirs=(headers,))
    persistent = "int persistent" in source.read_text()
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    head = [p, p, ll, i, p, p, i, i, p, p, p, i, i, i, i, i, i, i, i, i, i]
    lib.mxgemm_grouped_fp8.argtypes = [*head, *([i] if persistent else []), p]
    lib.mxgemm_grouped_fp8.restype = i
    return lib, persistent


def call(variant, xq, xs, rows, qd, bs, offsets, n, config, y) -> torch.Tensor:
    lib, takes_persistent = variant
    e, _, k = qd.shape
    args = [qd.data_ptr(), bs.data_ptr(), bs.stride(0), bs.stride(1), xq.data_ptr(), xs.data_ptr(), xs.shape[1]]
    args += [xq.shape[0], offsets.data_ptr(), None, y.data_ptr(), y.stride(0), 0, rows, e, n, k]
    args += [config.tn, config.wn, config.stages, token_tile_slots(rows, e, config.tn)]
    args += [int(config.persistent)] if takes_persistent else []
    err = lib.mxgemm_grouped_fp8(*args, raw_stream(xq.device.index))
    if err:
        raise RuntimeError(f"CUDA error {err}")
    return y


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="+", help="NAME=FOLDER")
    parser.add_argument("--json")
    parser.add_argument("--large", action="store_true", help="the LARGE problems instead of PROBLEMS")
    parser.add_argument("--no-wide", action="store_true", help="leave out the WIDE configs")
    parser.add_argument("--persistent", action="store_true", help="each config on the persistent grid as well")
    args = parser.parse_args()
    variants = {}
    for spec in args.variants:
        name, folder = spec.split("=", 1)
        variants[name] = load(Path(folder))
    cuda = torch.device("cuda")
    out, weights = [], {}
    print(f"{'problem':34s} {'config':44s} " + " ".join(f"{v:>9s}" for v in variants), flush=True)
    for model, proj, tokens, configs in LARGE if args.large else PROBLEMS:
        e, hidden, width, topk = MOE_MODELS[model]
        n, k = (2 * width, hidden) if proj == "gate_up" else (hidden, width)
        if (model, proj) not in weights:
            weights.clear()
            torch.cuda.empty_cache()
            weights[(model, proj)] = mxgemm.prepare_grouped_weight(*random_experts(e, n, k, seed=1, device=cuda))
        w = weights[(model, proj)]
        qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
        rows = tokens * topk
        routings = [routing_offsets(tokens, e, topk, seed=r, device=cuda)[0] for r in range(8)]
        quantized = [quantize_rows(torch.randn(rows, k, device=cuda).bfloat16()) for _ in routings]
        ref, worst = None, 0.0
        configs = [c for c in configs if not (args.no_wide and c in WIDE)]
        if args.persistent:
            twins = [dataclasses.replace(c, persistent=True) for c in configs]
            configs = list(dict.fromkeys(c for pair in zip(configs, twins, strict=True) for c in pair))
        for config in configs:
            res = {}
            for name, variant in variants.items():
                if config.persistent and not variant[1]:
                    continue
                outs = [torch.empty((rows, n), dtype=torch.bfloat16, device=cuda) for _ in routings]
                try:
                    y = call(variant, *quantized[0], rows, qd, bs, routings[0], n, config, outs[0]).clone()
                except RuntimeError:  # a config this version does not have
                    continue
                ref = y.float() if ref is None else ref
                worst = max(worst, ((y.float() - ref).norm() / ref.norm()).item())
                res[name] = time_cuda(
                    [
                        partial(call, variant, *xq, rows, qd, bs, o, n, config, yo)
                        for xq, o, yo in zip(quantized, routings, outs, strict=True)
                    ]
                )
            cells = " ".join(f"{res[v]:9.1f}" if v in res else f"{'-':>9s}" for v in variants)
            print(f"{model:14s} {proj:7s} T={tokens:5d}      {config!s:44s} {cells}  diff {worst:.1e}", flush=True)
            row = {"model": model, "proj": proj, "tokens": tokens, "config": str(config), "us": res, "diff": worst}
            out.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
