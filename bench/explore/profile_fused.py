"""Run the fused FP8 kernel (activations quantized in shared memory) a few times on one shape, for Nsight Compute:

ncu --section WarpStateStats --section SourceCounters -k regex:fp8_gemm -s 2 -c 1 \\
    python3 profile_fused.py --n 4096 --k 4096 --m 64
"""

from __future__ import annotations

import argparse

import torch

import mxgemm
from mxgemm.backends.hybrid_sm90 import fp8_default
from mxgemm.kernels import fp8_gemm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, default=64)
    args = parser.parse_args()
    t = mxgemm.quantize(torch.randn(args.n, args.k, device="cuda").mul_(0.02).bfloat16())
    w = mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90")
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = fp8_default(args.m, *qd.shape, sms)
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        fp8_gemm.fp8_linear(x, qd, bs, args.n, cfg, fused=True)
    torch.cuda.synchronize()
    print(cfg)


if __name__ == "__main__":
    main()
