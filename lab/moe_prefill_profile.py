"""Where a Qwen3-MoE of Qwen3-30B-A3B dimensions (a few layers) spends its time, bf16 (transformers' ``grouped_mm``
experts) against mxgemm: a 2048-token prefill's median wall time and torch.profiler's kernels by GPU time, and an
eager one-token decode step's median wall time and its operators by host (self CPU) time.

Run on the device: PYTHONPATH=src python3 lab/moe_prefill_profile.py --layers 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build, config


def median_ms(fn, warmup: int, rounds: int) -> float:
    """Median wall milliseconds of ``fn``, each call synchronised, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=22)
    args = parser.parse_args()
    cfg = config(args.layers, tiny=False, moe=True)
    ids = torch.randint(0, 100000, (1, args.tokens), device="cuda")
    with torch.inference_mode():
        for who in ("bf16", "mxgemm"):
            model, _ = build(cfg, who, ())

            def forward(model=model):
                return model(ids, use_cache=False, logits_to_keep=1)

            print(f"== {who}: prefill {args.tokens}, median {median_ms(forward, 3, 7):.2f} ms", flush=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                forward()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows), flush=True)
            out = model(ids[:, :64], use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)

            def step(model=model, cache=cache, token=token):
                return model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)

            print(f"== {who}: eager decode step, median {median_ms(step, 5, 20):.2f} ms", flush=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)
            del model, cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
