"""Run the FP8 TMA/wgmma kernel a few times on one shape and config, for Nsight Compute:

ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats -k regex:fp8_gemm -c 1 \\
    python3 profile_fp8_gemm.py --n 4096 --k 4096 --m 64 --config tn64-rw1-s2-st4 [--variant ring-only]

``--variant`` runs one of explore_fp8_bounds.py's patched builds (no-mma, no-act, no-reduce, ring-only) instead;
``--config cublas`` runs cuBLASLt's blockwise GEMM on the same operands (for ncu: ``-k regex:sm90``).
"""

from __future__ import annotations

import argparse

import torch
from explore_fp8_bounds import VARIANTS, patched_library
from explore_fp8_gemm import config_from_key, run
from explore_small_m_pipeline import hybrid, random_mx

from mxgemm.backends.cublas_block import cublas_block_linear
from mxgemm.kernels import fp8_gemm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--config", default="tn64-rw1-s2-st4")
    parser.add_argument("--variant", choices=list(VARIANTS))
    args = parser.parse_args()
    if args.variant:
        lib = patched_library(args.variant, VARIANTS[args.variant], torch.cuda.get_device_capability())
        fp8_gemm.library = lambda _cap: lib
    w = hybrid(*random_mx(args.n, args.k, 0))
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    if args.config == "cublas":
        call = lambda: cublas_block_linear(x, w, None)  # noqa: E731
    else:
        cfg = config_from_key(args.config)
        call = lambda: run(x, w, cfg)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
