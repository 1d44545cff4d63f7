"""The small-M kernel in a decode step's chain of kernels, two builds of it in one process: a CUDA graph of
``--layers`` Llama-3-8B layers at M tokens, each layer's four projections (qkv, o, gate_up, down) with a small
elementwise kernel before each (what a step runs between them: norms, attention, activations), replayed; and the
four projections back to back. Times of the two builds alternate; their outputs must have the same bits.

    python lab/pdl_chain.py --old DIR   # DIR: the other build's small_m.cu and graph_launch.cuh

`pdl-chain-h200.json`: small_m.cu at 4574b51 (old) against the same kernel launched as a programmatic dependent, its
first ring slices prefetched into L2 before ``griddepcontrol.wait`` (new; not kept, docs/performance.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
from pathlib import Path

import torch

from mxgemm.backends.hybrid_sm90 import small_m_default
from mxgemm.kernels import nvcc, small_m

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def load(source: Path):
    lib = nvcc.build(source, torch.cuda.get_device_capability(), symbols=("mxgemm_small_m",))
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.mxgemm_small_m.argtypes = [p, p, i, p, p, p, *[i] * 9, p]
    lib.mxgemm_small_m.restype = i
    return lib


def weights(layers: int, g: torch.Generator) -> list[dict]:
    """Each layer's four projections: random FP8 bytes (no NaN) [N, K] and fp32 block scales."""
    out = []
    for _ in range(layers):
        layer = {}
        for name, (n, k) in SHAPES.items():
            w = torch.randint(0, 256, (n, k), dtype=torch.uint8, device="cuda", generator=g)
            w = torch.where((w & 0x7F) == 0x7F, w & 0xF0, w)  # no NaN bytes
            layer[name] = (w, torch.full((n // 128, k // 128), 2.0**-8, device="cuda"))
        out.append(layer)
    return out


def alternating_us(replays: dict, rounds: int, reps: int = 5) -> dict[str, list[float]]:
    """µs a replay of each named graph (``replays``: name -> its ``replay``), ``reps`` replays a round between CUDA
    events, the order reversed every other round."""
    times = {who: [] for who in replays}
    for r in range(rounds):
        for who in list(replays) if r % 2 == 0 else list(replays)[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                replays[who]()
            end.record()
            end.synchronize()
            times[who].append(start.elapsed_time(end) / reps * 1e3)
    return times


def gemm(lib, layer, name, x):
    n, k = SHAPES[name]
    w, s = layer[name]
    cfg = small_m_default(n, k)
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
    err = lib.mxgemm_small_m(w.data_ptr(), s.data_ptr(), s.stride(0), x.data_ptr(), None, y.data_ptr(), n,
                             x.shape[0], k, n, n, k, cfg.rt, cfg.splits, cfg.stages,
                             ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))  # fmt: skip
    assert err == 0, err
    return y


def step(lib, layers, x, wide, between: bool):
    """Every layer's four outputs; ``between``: an elementwise kernel before each projection (each layer from x)."""
    outs = []
    for layer in layers:
        if between:
            t = x * 1.0001
            qkv = gemm(lib, layer, "qkv", t)
            o = gemm(lib, layer, "o", qkv[:, :4096] * 1.0)
            t2 = o + x
            gu = gemm(lib, layer, "gate_up", t2)
            down = gemm(lib, layer, "down", gu[:, :14336] * gu[:, 14336:])
        else:
            qkv, o = gemm(lib, layer, "qkv", x), gemm(lib, layer, "o", x)
            gu, down = gemm(lib, layer, "gate_up", x), gemm(lib, layer, "down", wide)
        outs += [qkv, o, gu, down]
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    libs = {"old": load(args.old / "small_m.cu"), "new": load(Path(small_m._SOURCE))}
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = weights(args.layers, g)
    rows = []
    for m in args.m:
        x = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda", generator=g)
        wide = torch.randn(m, 14336, dtype=torch.bfloat16, device="cuda", generator=g)
        for between in (True, False):
            graphs, outs = {}, {}
            for who, lib in libs.items():
                for _ in range(2):
                    step(lib, layers, x, wide, between)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs[who] = step(lib, layers, x, wide, between)
                graphs[who] = graph
            for graph in graphs.values():
                graph.replay()
            torch.cuda.synchronize()
            same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"], strict=True))
            times = alternating_us({who: graph.replay for who, graph in graphs.items()}, args.rounds)
            row = {"m": m, "between": between, "same_bits": same,
                   **{f"{who}_us": statistics.median(t) for who, t in times.items()},
                   **{f"{who}_spread": [min(t), max(t)] for who, t in times.items()}}  # fmt: skip
            row["gain_us_per_gemm"] = (row["old_us"] - row["new_us"]) / (4 * args.layers)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del graphs
    print(f"\n{args.layers} layers, medians of {args.rounds} rounds of 5 replays ({torch.cuda.get_device_name()})")
    print("| M | kernels between | old µs | new µs | new/old | gain µs a GEMM | same bits |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['m']} | {'yes' if r['between'] else 'no'} | {r['old_us']:.0f} | {r['new_us']:.0f} | "
              f"{r['new_us'] / r['old_us']:.3f} | {r['gain_us_per_gemm']:.2f} | {r['same_bits']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
