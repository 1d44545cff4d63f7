"""Run one of mxgemm's CUDA kernels a few times on one shape, for Nsight Compute (``h200_pending.sh fp8-ncu`` and
``small-m-ncu``): the fused FP8 kernel (activations quantized in shared memory) or the small-M kernel, each with its
default config for the shape.

ncu --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:small_m -s 2 -c 1 \\
    python3 profile_kernel.py --kernel small-m --n 28672 --k 4096 --m 1
ncu --section WarpStateStats --section SourceCounters -k regex:fp8_gemm -s 2 -c 1 \\
    python3 profile_kernel.py --kernel fused --n 4096 --k 4096 --m 64
"""

from __future__ import annotations

import argparse

import torch

import mxgemm
from mxgemm.backends.hybrid_sm90 import fp8_default, small_m_default
from mxgemm.kernels import fp8_gemm, small_m


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernel", choices=("fused", "small-m"), required=True)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, default=64)
    args = parser.parse_args()
    t = mxgemm.quantize(torch.randn(args.n, args.k, device="cuda").mul_(0.02).bfloat16())
    w = mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90")
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    if args.kernel == "fused":
        cfg = fp8_default(args.m, *qd.shape, torch.cuda.get_device_properties(0).multi_processor_count)
        run = lambda: fp8_gemm.fp8_linear(x, qd, bs, args.n, cfg, fused=True)  # noqa: E731
    else:
        cfg = small_m_default(*qd.shape)
        run = lambda: small_m.small_m_linear(x, qd, bs, args.n, cfg)  # noqa: E731
    for _ in range(4):
        run()
    torch.cuda.synchronize()
    print(cfg)


if __name__ == "__main__":
    main()
