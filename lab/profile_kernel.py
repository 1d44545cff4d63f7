"""Run one of mxgemm's CUDA kernels a few times on one shape, for Nsight Compute (``h200_pending.sh fp8-ncu`` and
``small-m-ncu``): the swap-AB FP8 kernel (after its quantizer) or the small-M kernel, each with its default config
for the shape; at prefill sizes, the tokens-as-M FP8 kernel (128 x 128 tiles) or cuBLASLt's blockwise
GEMM (``tokm``, ``cublas``; the quantizer runs before each).

ncu --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:small_m -s 2 -c 1 \\
    python3 profile_kernel.py --kernel small-m --n 28672 --k 4096 --m 1
ncu --section WarpStateStats --section SourceCounters -k regex:fp8_gemm -s 2 -c 1 \\
    python3 profile_kernel.py --kernel swap-ab --n 4096 --k 4096 --m 64
"""

from __future__ import annotations

import argparse
import functools

import torch

import mxgemm
from mxgemm.backends import get_backend
from mxgemm.backends.base import Tactic
from mxgemm.backends.hybrid_sm90 import Path, fp8_default, small_m_default
from mxgemm.kernels import fp8_gemm, small_m
from mxgemm.kernels.fp8_gemm import TokensAsM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernel", choices=("swap-ab", "small-m", "tokm", "cublas"), required=True)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, default=64)
    args = parser.parse_args()
    t = mxgemm.quantize(torch.randn(args.n, args.k, device="cuda").mul_(0.02).bfloat16())
    w = mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90")
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    if args.kernel == "swap-ab":  # the quantizer and the FP8 kernel's default config at this M
        cfg = fp8_default(args.m, *qd.shape, torch.cuda.get_device_properties(0).multi_processor_count)
        run = lambda: fp8_gemm.fp8_linear(x, qd, bs, args.n, cfg)  # noqa: E731
    elif args.kernel == "tokm":  # the tokens-as-M kernel at prefill sizes: 128 tokens x 128 weight rows a CTA
        cfg = TokensAsM(128, 128, splits=1, stages=6)
        run = lambda: fp8_gemm.fp8_linear(x, qd, bs, args.n, cfg)  # noqa: E731
    elif args.kernel == "cublas":  # cuBLASLt's blockwise GEMM as hybrid_sm90 plans it, for comparison
        cfg = Tactic(Path.CUBLAS)
        run = functools.partial(get_backend("hybrid_sm90").plan(w, args.m, x.dtype, cfg), x, None)
    else:
        cfg = small_m_default(*qd.shape)
        run = lambda: small_m.small_m_linear(x, qd, bs, args.n, cfg)  # noqa: E731
    for _ in range(4):
        run()
    torch.cuda.synchronize()
    print(cfg)


if __name__ == "__main__":
    main()
