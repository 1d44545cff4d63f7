"""Where an eager decode step's host time goes in a Hugging Face Llama (8B dimensions, a few layers): the step's wall
time, and the host time spent inside the linear layers' ``forward`` (``nn.Linear`` for bf16, ``MXFP8Linear`` for
mxgemm), timed with a wrapper around each call, for batch 1 and 64.

Run on the device: PYTHONPATH=src python3 lab/decode_host.py --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build

import mxgemm


def instrument(model: torch.nn.Module, spent: list[float], counts: list[int]) -> None:
    """Wrap every linear layer's forward to add its host time to ``spent[0]``."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, mxgemm.MXFP8Linear)):
            inner = module.forward

            def timed(x, inner=inner):
                t0 = time.perf_counter()
                y = inner(x)
                spent[0] += time.perf_counter() - t0
                counts[0] += 1
                return y

            module.forward = timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    for who in ("bf16", "mxgemm"):
        model, _ = build(args.layers, who, ())
        spent, counts = [0.0], [0]
        instrument(model, spent, counts)
        for batch in (1, 64):
            ids = torch.randint(100, 120000, (batch, 64), device="cuda")
            with torch.inference_mode():
                cache = transformers.DynamicCache(config=model.config)
                out = model(ids, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1:].argmax(-1)
                steps, linear_us, sync_steps = [], [], []
                for i in range(args.steps):
                    spent[0], counts[0] = 0.0, 0
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = model(nxt, past_key_values=cache, use_cache=True)
                    t1 = time.perf_counter()
                    nxt = out.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    if i >= 4:
                        steps.append((t1 - t0) * 1e6)
                        sync_steps.append((t2 - t0) * 1e6)
                        linear_us.append(spent[0] * 1e6)
                calls = counts[0]
            step, lin, synced = statistics.median(steps), statistics.median(linear_us), statistics.median(sync_steps)
            print(f"{who:7s} batch {batch:3d}: step host {step:8.0f} us (synchronized {synced:8.0f}), linears "
                  f"{lin:7.0f} us in {calls} calls ({lin / calls:5.1f} us a call), rest {step - lin:7.0f} us",
                  flush=True)  # fmt: skip
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
