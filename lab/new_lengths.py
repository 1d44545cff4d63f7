"""What a prompt of a length not seen before costs in an eager prefill. Every weight makes one launch plan per M on
first use (``ops.run_planned``; on the cuBLAS path a cuBLASLt plan, its heuristic included), and the benchmarks repeat
one prompt length, so they never pay it; prompts of varying length pay it on every new length. Per model (a Llama at
8B dimensions, bf16 and mxgemm, 32 layers): ``generate`` of one token on prompts of lengths not seen before, then on
the same lengths again; and the host time of making one plan on the 8B q and gate weights at new M.

Run on the device: PYTHONPATH=src python3 lab/new_lengths.py --json new-lengths.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build

from mxgemm.backends import get_backend

LENGTHS = (701, 1003, 1537, 1999, 2047)  # none a length the warm-up used


def generate_ms(model, length: int, g: torch.Generator) -> float:
    ids = torch.randint(1, model.config.vocab_size, (1, length), device="cuda", generator=g)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, disable_compile=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def plan_us(weight, m: int) -> float:
    """Host time of making the weight's plan for M rows (the tactic its call would get: the default)."""
    backend = get_backend(weight.backend)
    torch.cuda.synchronize()
    start = time.perf_counter()
    backend.plan(weight, m, torch.bfloat16)
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    with torch.inference_mode():
        for who in ("bf16", "mxgemm"):
            model, _ = build(32, who, ())
            g = torch.Generator(device="cuda").manual_seed(0)
            for _ in range(2):
                generate_ms(model, 2048, g)  # warm-up: kernels built, plans for 2048 rows made
            row = {"who": who, "lengths": LENGTHS}
            row["first_ms"] = [generate_ms(model, n, g) for n in LENGTHS]
            row["again_ms"] = [generate_ms(model, n, g) for n in LENGTHS]
            if who == "mxgemm":
                attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
                weights = {"q": attn.q_proj.prepared, "gate": mlp.gate_proj.prepared,
                           "o": attn.o_proj.prepared, "down": mlp.down_proj.prepared}  # fmt: skip
                fresh = (300, 777, 1500, 3001)
                row["plan_us"] = {name: {m: plan_us(w, m) for m in fresh} for name, w in weights.items()}
                row["plans_per_layer"] = sum(
                    len(m.prepared.plans.launch) for m in model.model.layers[0].modules() if hasattr(m, "prepared")
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
            del model
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print("| who | " + " | ".join(f"{n} first / again ms" for n in LENGTHS) + " |")
    print("|---|" + "---|" * len(LENGTHS))
    for r in rows:
        cells = " | ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(r["first_ms"], r["again_ms"], strict=True))
        print(f"| {r['who']} | {cells} |")


if __name__ == "__main__":
    main()
