"""Diagnosis (docs/performance.md): why `mxgemm bench` timed the FP8 path ~8% slower than the tuner and the
exploration. Same weights, the first timing after weight preparation with and without an untimed warm-up replay,
then again at once."""

from functools import partial

import torch

import mxgemm
from mxgemm.bench import mx_weights
from mxgemm.timing import time_cuda

for n, k in ((57344, 8192), (8192, 28672), (36864, 7168)):
    for warm in (0.0, 50.0, 0.0, 50.0):
        mx = mx_weights(n, k, "cuda", 2)
        ws = [mxgemm.prepare_weight(q, s) for q, s in mx]
        torch.cuda.synchronize()
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        calls = [partial(mxgemm.linear, x, w) for w in ws]
        first = time_cuda(calls, warmup_ms=warm)
        again = time_cuda(calls, warmup_ms=warm)
        print(f"{n}x{k} M=1 warm-up {warm:4.0f} ms: first {first:7.1f} again {again:7.1f}", flush=True)
        del ws, mx
        torch.cuda.empty_cache()
