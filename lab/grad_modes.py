"""What running the q/k/v groups apart under ``torch.inference_mode`` costs: a Llama at 8B dimensions (``--layers``),
bf16 and mxgemm, eager ``generate`` under ``torch.no_grad`` (Hugging Face's own mode: the q/k/v groups run as one)
against under ``torch.inference_mode`` (inference tensors keep no version counter, so q/k/v run apart): the time of
a ``generate`` call of 64 new tokens after a 512-token prompt at batch 1 and 16, and of a 2048-token prefill, the modes
alternating in each round, each figure the median of the rounds.

Run on the device: PYTHONPATH=src python3 lab/grad_modes.py --layers 16 --json grad-modes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build, config

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def timed(model, ids, new: int, mode: str) -> float:
    with MODES[mode]():
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    made = config(args.layers, tiny=False, moe=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    prompts = {b: torch.randint(1, made.vocab_size, (b, 512), device="cuda", generator=g) for b in (1, 16)}
    long_ids = torch.randint(1, made.vocab_size, (1, 2048), device="cuda", generator=g)
    results = {}
    for who in ("mxgemm", "bf16"):
        model, _ = build(made, who, skip=("lm_head",))
        cases = {f"decode b{b}": (ids, args.new) for b, ids in prompts.items()} | {"prefill 2048": (long_ids, 1)}
        times = {(case, mode): [] for case in cases for mode in MODES}
        for ids, new in cases.values():
            for mode in MODES:
                timed(model, ids, new, mode)  # warm-up: plans made, kernels built
        for r in range(args.rounds):
            for case, (ids, new) in cases.items():
                for mode in MODES if r % 2 == 0 else list(MODES)[::-1]:
                    times[case, mode].append(timed(model, ids, new, mode))
        for (case, mode), seconds in times.items():
            ms = statistics.median(seconds) * 1e3
            results[f"{who} {case} {mode}"] = ms
            print(f"{who:7s} {case:13s} {mode:15s} {ms:9.2f} ms", flush=True)
        del model
        torch.cuda.empty_cache()
    print("\ncase           inference_mode / no_grad   (mxgemm | bf16)")
    for case in ("decode b1", "decode b16", "prefill 2048"):
        ratio = [results[f"{w} {case} inference_mode"] / results[f"{w} {case} no_grad"] for w in ("mxgemm", "bf16")]
        print(f"{case:13s}  {ratio[0]:.3f} | {ratio[1]:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"layers": args.layers, "new": args.new, "ms": results}, indent=1))


if __name__ == "__main__":
    main()
