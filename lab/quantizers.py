"""The two 1x128 activation quantizers (the CUDA one of ``kernels/csrc/fp8_gemm.cu``, which eager calls use, and the
Triton one of ``kernels/act_quant.py``) under CUDA-graph replay, alone and in front of cuBLASLt's blockwise GEMM, on
the Llama-3-8B and Qwen2.5-7B projections at M = 64-4096; bits compared. It decides whether graph-captured calls from
M = 256 should quantize with Triton (``docs/performance.md``: the CUDA quantizer costs 3-16% there).

Run on the device: PYTHONPATH=src python3 lab/quantizers.py --json quantizers.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

import mxgemm
from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.act_quant import quantize_1x128_padded
from mxgemm.kernels.cublaslt import blockwise_linear
from mxgemm.timing import copies_for_cold_l2, time_cuda

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4608, 3584), (3584, 18944))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[64, 256, 1024, 2048, 4096])
    parser.add_argument("--json")
    args = parser.parse_args()
    dev = mxgemm.describe_device()
    rows = []
    for n, k in SHAPES:
        t = mxgemm.quantize(torch.randn(n, k, device="cuda").mul_(0.02))
        copies = copies_for_cold_l2(n * k, dev.l2_bytes)
        ws = [mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90") for _ in range(copies)]
        for m in args.m:
            xs = [torch.randn(m, k, device="cuda").bfloat16() for _ in range(4)]
            (cq, cs), (tq, ts) = fp8_gemm.quantize_1x128(xs[0]), quantize_1x128_padded(xs[0])
            same = torch.equal(cq.view(torch.uint8), tq.view(torch.uint8)) and torch.equal(cs, ts)
            row = {"n": n, "k": k, "m": m, "bits_equal": same}
            for name, quantize in (("cuda", fp8_gemm.quantize_1x128), ("triton", quantize_1x128_padded)):
                row[f"{name}_quant_us"] = time_cuda([partial(quantize, x) for x in xs])
                calls = [partial(blockwise_linear, xs[i % 4], w.tensors["qdata"], w.tensors["block_scale"], n, None,
                                 quantize=quantize) for i, w in enumerate(ws)]  # fmt: skip
                row[f"{name}_linear_us"] = time_cuda(calls)
            rows.append(row)
            print(f"{n:6d} {k:6d} M={m:5d}  quantizer cuda {row['cuda_quant_us']:7.1f} triton "
                  f"{row['triton_quant_us']:7.1f}  + cuBLASLt cuda {row['cuda_linear_us']:7.1f} triton "
                  f"{row['triton_linear_us']:7.1f} µs  bits {'equal' if same else 'DIFFER'}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
