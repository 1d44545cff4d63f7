"""Run the small-M kernel a few times on one shape, for Nsight Compute (``h200_pending.sh small-m-ncu``):

ncu --section SpeedOfLight --section MemoryWorkloadAnalysis -k regex:small_m -s 2 -c 1 \\
    python3 profile_small_m.py --n 28672 --k 4096 --m 1
"""

from __future__ import annotations

import argparse

import torch

import mxgemm
from mxgemm.backends.hybrid_sm90 import small_m_default
from mxgemm.kernels import small_m


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=28672)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--m", type=int, default=1)
    args = parser.parse_args()
    t = mxgemm.quantize(torch.randn(args.n, args.k, device="cuda").mul_(0.02).bfloat16())
    w = mxgemm.prepare_weight(t.qdata, t.scale, backend="hybrid_sm90")
    qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
    cfg = small_m_default(*qd.shape)
    x = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        small_m.small_m_linear(x, qd, bs, args.n, cfg)
    torch.cuda.synchronize()
    print(cfg)


if __name__ == "__main__":
    main()
