"""Diagnosis (docs/performance.md): with 100 ms of untimed replays before each timing (SETTLE_MS), the benchmark
timed M >= 2048 10-20% slower than before, mxgemm more than bf16. Sustained FP8 tensor-core work held at the power
limit? Times mxgemm and bf16 cuBLAS at M = 8192 after 0, 100 and 1000 ms of untimed replays, with the SM clock,
power and clock-event reasons sampled every 20 ms (nvidia-smi, in the background) around each timing.

Run on the device: PYTHONPATH=src python3 lab/diag_power.py
"""

import subprocess
import time

import torch
import torch.nn.functional as F

import mxgemm
from mxgemm.bench import mx_weights
from mxgemm.timing import time_cuda

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


def sampled(fn):
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.3)
    us = fn()
    time.sleep(0.05)
    smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    busy = [(int(c), float(p), r.strip()) for c, p, r in rows if float(p) > 150]
    if not busy:
        return us, "no busy samples"
    clocks = sorted(c for c, _, _ in busy)
    reasons = sorted({r for _, _, r in busy})
    return us, f"SM clock {clocks[0]}-{clocks[-1]} MHz, max {max(p for _, p, _ in busy):.0f} W, reasons {reasons}"


def main() -> None:
    for m, n, k in ((8192, 8192, 8192), (8192, 4096, 4096)):
        mx = mx_weights(n, k, "cuda", 2)
        ws = [mxgemm.prepare_weight(q, s) for q, s in mx]
        bf = [mxgemm.dequantize(mxgemm.MXTensor(q, s), torch.bfloat16) for q, s in mx]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for warm in (0.0, 100.0, 1000.0, 0.0):
            for name, calls in (("mxgemm", [lambda w=w, x=x: mxgemm.linear(x, w) for w in ws]),
                                ("bf16", [lambda w=w, x=x: F.linear(x, w) for w in bf])):  # fmt: skip
                time.sleep(1.0)  # cool down between timings
                us, clk = sampled(lambda c=calls, wm=warm: time_cuda(c, warmup_ms=wm))
                print(f"{m}x{n}x{k} {name:>6} warm-up {warm:6.0f} ms: {us:8.1f} µs  {clk}", flush=True)
        del ws, bf, mx
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
