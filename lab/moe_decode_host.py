"""Where an eager decode step's host time goes in a Qwen3-MoE of Qwen3-30B-A3B dimensions (a few layers): each step's
wall time for bf16 (transformers' ``grouped_mm`` experts) and mxgemm, and the functions that take the host's time in
mxgemm's steps (cProfile, by own time), at batch 1.

Run on the device: PYTHONPATH=src python3 lab/moe_decode_host.py --layers 4
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build, config


def steps(model, ids, n: int) -> list[float]:
    """Wall seconds of ``n`` one-token decode steps after a 64-token prompt, each synchronised."""
    out = model(ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    cfg = config(args.layers, tiny=False, moe=True)
    ids = torch.randint(0, 1000, (1, 64), device="cuda")
    with torch.no_grad():
        for who in ("bf16", "mxgemm"):
            model, _ = build(cfg, who, ())
            steps(model, ids, 5)
            t = steps(model, ids, args.steps)
            print(f"{who}: median step {statistics.median(t) * 1e3:.2f} ms ({args.layers} layers)", flush=True)
            profile = cProfile.Profile()
            profile.enable()
            steps(model, ids, 10)
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(35)
            print(text.getvalue()[:12000], flush=True)
            del model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
