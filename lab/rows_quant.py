"""The routed rows' 1x128 quantizer (``kernels/grouped/quant.py``, which the wgmma kernel reads) at prefill sizes: its
launch as it ships (16 rows a program, 4 warps) beside other rows a program and warps (``quantize_rows``'s
``block_rows`` and ``warps``), bits compared, and the floor (bytes read and written over the copy bandwidth measured
here). Of Qwen3 gate/up's 381 µs at 4096 tokens in ``mxgemm bench --moe`` it takes about 73, 0.87x the copy floor of
its 203 MB (docs/performance.md): the plain form has little to gain; the gathered form reads each token's row from L2
``topk`` times and writes a third of the bytes, where programs of 4 KB may leave bandwidth unused.

Forms: gathered (gate/up's input: the tokens' rows at each sorted copy) and gated (down's: ``silu(gate) * up``).

Run on the device: PYTHONPATH=src python3 lab/rows_quant.py --json rows-quant.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from mxgemm.kernels.grouped.quant import quantize_rows
from mxgemm.timing import time_cuda

# model, tokens, top-k, hidden, expert width
PROBLEMS = (
    ("qwen3-30b-a3b", 4096, 8, 2048, 768),
    ("mixtral-8x7b", 4096, 2, 4096, 14336),
    ("deepseek-v3", 1024, 8, 7168, 2048),
)
LAUNCHES = ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8))  # rows a program, warps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    probe = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy_us = time_cuda([partial(torch.empty_like(probe).copy_, probe)])
    bandwidth = 2 * probe.numel() / (copy_us * 1e-6)  # bytes read plus written a second
    del probe
    print(f"copy {bandwidth / 1e12:.3f} TB/s (read plus written)")
    out = []
    for model, tokens, topk, hidden, width in PROBLEMS:
        rows = tokens * topk
        src = torch.randperm(rows, device="cuda", dtype=torch.int64).to(torch.int32)
        forms = (
            ("gathered", [torch.randn(tokens, hidden, device="cuda").bfloat16() for _ in range(2)], src, False),
            ("gated", [torch.randn(rows, 2 * width, device="cuda").bfloat16() for _ in range(2)], None, True),
        )
        for form, xs, s, gated in forms:
            k = xs[0].shape[1] // (2 if gated else 1)
            moved = rows * k * (2 * (2 if gated else 1) + 1) + rows * (k // 128) * 4
            ref = quantize_rows(xs[0], s, topk, gated=gated)
            for per, warps in LAUNCHES:
                launch = {"gated": gated, "block_rows": per, "warps": warps}
                q, sc = quantize_rows(xs[0], s, topk, **launch)
                same = torch.equal(q, ref[0]) and torch.equal(sc, ref[1])
                us = time_cuda([partial(quantize_rows, x, s, topk, **launch) for x in xs])
                row = {"model": model, "form": form, "rows": rows, "k": k, "rows_per_program": per, "warps": warps}
                row |= {"us": us, "floor_us": moved / bandwidth * 1e6, "same_bits": same}
                out.append(row)
                bits = "equal" if same else "DIFFER"
                shape = f"{model:14s} {form:8s} {rows:6d} x {k:5d}  {per:3d} rows {warps} warps"
                print(f"{shape}  {us:7.1f} µs  floor {row['floor_us']:6.1f}  bits {bits}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bandwidth, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
