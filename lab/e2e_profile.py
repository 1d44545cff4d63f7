"""Where a Llama (8B dimensions, a few layers) spends ``generate`` time, bf16 against mxgemm: torch.profiler tables of
a 512-token prefill and of decode steps, eager and (``--graphs``) compiled with CUDA graphs as ``bench/model_e2e.py``
runs them, and the GPU time of each linear at M = 1, 512 and 2048.

Run on the device: PYTHONPATH=src python3 lab/e2e_profile.py --layers 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build

import mxgemm


def gpu_us(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=18)
    parser.add_argument("--graphs", action="store_true", help="also profile decode steps under CUDA graphs")
    parser.add_argument("--batch", type=int, default=1, help="prompts of the generate calls profiled")
    args = parser.parse_args()
    for who in ("bf16", "mxgemm"):
        model, _ = build(args.layers, who, ())
        ids = torch.randint(100, 120000, (args.batch, 512), device="cuda")
        with torch.inference_mode():
            for m in (1, 512, 2048):
                x = torch.randn(1, m, 4096, device="cuda", dtype=torch.bfloat16)
                layer = model.model.layers[0]
                times = {
                    name: gpu_us(lambda mod=mod, x=x: mod(x))
                    for name, mod in (
                        ("q", layer.self_attn.q_proj),
                        ("k", layer.self_attn.k_proj),
                        ("gate", layer.mlp.gate_proj),
                    )
                }
                xd = torch.randn(1, m, 14336, device="cuda", dtype=torch.bfloat16)
                times["down"] = gpu_us(lambda xd=xd, layer=layer: layer.mlp.down_proj(xd))
                print(who, f"M={m}", {k: round(v, 1) for k, v in times.items()}, flush=True)
            kw = {"do_sample": False, "disable_compile": True}
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
            torch.cuda.synchronize()
            for what, new in (("prefill 512", 1), ("prefill + 16 decode steps", 17)):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
                    torch.cuda.synchronize()
                print(f"== {who}: {what}", flush=True)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=8), flush=True)
            if args.graphs:  # static cache, the decode step compiled with CUDA graphs (as model_e2e.py's graphs mode)
                kw = {"do_sample": False, "cache_implementation": "static",
                      "compile_config": transformers.CompileConfig(dynamic=False)}  # fmt: skip
                for _ in range(2):
                    model.generate(ids, max_new_tokens=17, min_new_tokens=17, **kw)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    model.generate(ids, max_new_tokens=17, min_new_tokens=17, **kw)
                    torch.cuda.synchronize()
                print(f"== {who}: prefill + 16 decode steps, graphs", flush=True)
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows), flush=True)
        del model
        torch.cuda.empty_cache()
    print(mxgemm.__version__)


if __name__ == "__main__":
    main()
