"""What one eager call costs: an ``MXFP8Linear`` against ``F.linear`` in bf16, outside CUDA graphs, as Hugging Face
``generate`` runs them.

Each contender runs ``--calls`` times back to back over layers rotated so that their weights exceed 3x the L2 (as a
model's layers do), synchronized once at the end: the time per call is what the host (Python, launches) or the GPU,
whichever is slower, makes the caller wait. Contenders: bf16 ``F.linear`` (with the bias where the model has one),
``mxgemm`` (the layer as users call it), and ``mxgemm-op`` (the same layer through the ``mxgemm::linear`` op,
as a compiled graph calls it, on the rows flattened beforehand). The activations are [M, 1, K], as a decode step of
M sequences passes them. Median of ``--repeats`` rounds.

Run on the device: PYTHONPATH=src python3 bench/eager_calls.py --json eager.json --markdown eager.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.bench import environment
from mxgemm.ops import linear_op
from mxgemm.timing import copies_for_cold_l2

# (model, projection, N, K, bias)
PROJECTIONS = [
    ("llama3-8b", "qkv", 6144, 4096, False),
    ("llama3-8b", "o", 4096, 4096, False),
    ("llama3-8b", "gate_up", 28672, 4096, False),
    ("llama3-8b", "down", 4096, 14336, False),
    ("qwen2.5-7b", "qkv", 4608, 3584, True),
    ("qwen2.5-7b", "o", 3584, 3584, False),
    ("qwen2.5-7b", "gate_up", 37888, 3584, False),
    ("qwen2.5-7b", "down", 3584, 18944, False),
]


def per_call_us(fn, inputs, calls: int, repeats: int) -> float:
    """Median over rounds of (wall time of ``calls`` back-to-back calls, then one synchronize) / calls."""
    for x in inputs[:3]:
        fn(0, x)
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i, inputs[i % len(inputs)])
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def cold_layers(n: int, k: int, has_bias: bool, l2_bytes: int | None, g: torch.Generator):
    """(bf16 weights [n, k], bias or None, their ``MXFP8Linear`` layers): enough copies that the bf16 weights exceed
    3x the L2, drawn from ``g``, so that calls rotating over them read their weights from memory."""
    count = copies_for_cold_l2(n * k * 2, l2_bytes)
    dense = [torch.randn(n, k, device="cuda", generator=g).mul_(0.02).bfloat16() for _ in range(count)]
    bias = torch.randn(n, device="cuda", generator=g).bfloat16() if has_bias else None
    layers = []
    for w in dense:
        t = mxgemm.quantize(w)
        layers.append(mxgemm.MXFP8Linear.from_quantized(t.qdata, t.scale, bias))
    return dense, bias, layers


def projection_rows(model: str, proj: str, n: int, k: int, has_bias: bool, args, l2_bytes: int | None) -> list:
    g = torch.Generator(device="cuda").manual_seed(0)
    dense, bias, layers = cold_layers(n, k, has_bias, l2_bytes, g)
    count = len(dense)
    prepared = [layer.prepared for layer in layers]

    def via_op(i: int, x: torch.Tensor) -> torch.Tensor:
        w = prepared[i % count]
        return linear_op(x, w.op_tensors, bias, w.backend, w.op_meta)

    contenders = {
        "bf16": lambda i, x: F.linear(x, dense[i % count], bias),
        "mxgemm": lambda i, x: layers[i % count](x),
        "mxgemm-op": via_op,
    }
    rows = []
    for m in args.m:
        xs = [torch.randn(m, 1, k, device="cuda", generator=g).bfloat16() for _ in range(4)]
        row = {"model": model, "proj": proj, "n": n, "k": k, "bias": has_bias, "m": m, "backend": layers[0].backend}
        for name, fn in contenders.items():
            inputs = [x.view(m, k) for x in xs] if name == "mxgemm-op" else xs  # the op takes rows [M, K]
            row[f"{name}_us"] = per_call_us(fn, inputs, args.calls, args.repeats)
        row["ratio"] = row["mxgemm_us"] / row["bf16_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 24, 32, 64])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    device = mxgemm.describe_device()
    rows = []
    with torch.inference_mode():
        for projection in PROJECTIONS:
            rows += projection_rows(*projection, args, device.l2_bytes)
            torch.cuda.empty_cache()
    env = environment(device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": env, "calls": args.calls, "repeats": args.repeats, "rows": rows}, f, indent=1)
    lines = [
        f"Eager per-call time (µs; activations [M, 1, K]; {args.calls} calls back to back, weights L2-cold, median of "
        f"{args.repeats}); {env}",
        "",
        "| model | proj | N x K | M | bf16 F.linear | mxgemm | mxgemm via op | mxgemm / bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = f"{r['proj']}{' +bias' if r['bias'] else ''}"
        lines.append(f"| {r['model']} | {name} | {r['n']}x{r['k']} | {r['m']} | {r['bf16_us']:.1f} | "
                     f"{r['mxgemm_us']:.1f} | {r['mxgemm-op_us']:.1f} | {r['ratio']:.2f} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
