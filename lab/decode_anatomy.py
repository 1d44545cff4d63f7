"""Where a compiled (CUDA-graph) decode step of a Llama at 8B dimensions (``--moe``: the Qwen3-MoE at Qwen3-30B-A3B
dimensions) spends its time, bf16 against mxgemm, as ``bench/model_e2e.py``'s graphs mode runs it: the step's wall
time, the GPU's busy time within it, its kernels by kind (projections, the experts, attention, Inductor's fused
kernels, the rest), the host gaps between them, and the model's projections replayed alone in model order (one CUDA
graph of every linear call a step makes; with ``--moe`` the attention's and lm_head, the experts apart).

The decode steps' kernels are those of ``generate`` with 1 + S new tokens less those of ``generate`` with one (the
prefill, eager in both modes, and the first token).

Run on the device: PYTHONPATH=src python3 lab/decode_anatomy.py --layers 32 --batch 1 --json anatomy.json
(``--moe --layers 24`` for the MoE model).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build, config

KINDS = (  # the first kind whose keys a kernel's name holds
    ("experts", ("grouped", "moe::", "_rows_kernel", "_count_kernel", "_place_kernel", "_combine_kernel")),
    ("mxgemm", ("small_m", "fp8_gemm", "quant_1x128")),
    ("cublas", ("gemm", "gemv", "nvjet", "cutlass", "xmma")),
    ("attention", ("flash", "fmha", "attn", "attention", "sdpa", "cudnn")),
    ("inductor", ("triton",)),
)


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(s in low for s in keys)), "other")


def kernels(model, ids, new: int, kw: dict) -> tuple[list[tuple[str, int, int]], collections.Counter]:
    """(name, start ns, end ns) of every GPU activity of one ``generate``, in start order; the host's events (CPU
    ops, runtime calls) by name: (count, ns)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
        torch.cuda.synchronize()
    gpu, host = [], collections.defaultdict(lambda: [0, 0])
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            gpu.append((e.name(), e.start_ns(), e.end_ns()))
        else:
            host[e.name()][0] += 1
            host[e.name()][1] += e.duration_ns()
    return sorted(gpu, key=lambda k: k[1]), host


def busy_ns(ks) -> int:
    """The union of the intervals' lengths."""
    total, end = 0, None
    for _, s, e in ks:
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def wall(model, ids, new: int, kw: dict) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def projections_alone_us(model, batch: int) -> float:
    """GPU time of one CUDA-graph replay of every linear call of a decode step (each layer's q, k, v, o, gate, up and
    down, then lm_head) on [batch, 1, K] inputs, in model order."""
    cfg = model.config
    x = torch.randn(batch, 1, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    xd = torch.randn(batch, 1, getattr(cfg, "intermediate_size", 1), device="cuda", dtype=torch.bfloat16)

    xo = torch.randn(batch, 1, cfg.num_attention_heads * cfg.head_dim, device="cuda", dtype=torch.bfloat16)

    def step():
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            a.q_proj(x), a.k_proj(x), a.v_proj(x), a.o_proj(xo)
            if hasattr(m, "gate_proj"):  # a dense MLP; the MoE's experts are not linear layers
                m.gate_proj(x), m.up_proj(x), m.down_proj(xd)
        model.lm_head(x)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def anatomy(who: str, args) -> dict:
    torch._dynamo.reset()  # each model its own compiled code and counters (the models share their forward's code)
    torch._dynamo.utils.counters.clear()
    model, _ = build(config(args.layers, False, args.moe), who, ())
    kw = {"cache_implementation": "static", "compile_config": transformers.CompileConfig(dynamic=False)}
    g = torch.Generator(device="cuda").manual_seed(args.batch)
    ids = torch.randint(1, model.config.vocab_size, (args.batch, 512), device="cuda", generator=g)
    steps = args.steps
    result = {"who": who, "batch": args.batch, "layers": args.layers, "moe": args.moe, "steps": steps}
    with torch.inference_mode():
        for _ in range(2):  # compile, record, capture
            wall(model, ids, 1 + steps, kw)
        firsts, fulls = [], []
        for _ in range(args.repeats):
            firsts.append(wall(model, ids, 1, kw))
            fulls.append(wall(model, ids, 1 + steps, kw))
        step_ms = (statistics.median(fulls) - statistics.median(firsts)) / steps * 1e3
        first, host_first = kernels(model, ids, 1, kw)
        full, host_full = kernels(model, ids, 1 + steps, kw)
        host = {n: (c - host_first[n][0], t - host_first[n][1]) for n, (c, t) in host_full.items()}
        decode = full[len(first) :]
        by_kind, by_name = collections.Counter(), collections.defaultdict(lambda: [0, 0])
        for name, s, e in decode:
            by_kind[kind(name)] += e - s
            by_name[name][0] += 1
            by_name[name][1] += e - s
        gaps = [b[1] - a[2] for a, b in itertools.pairwise(decode)]
        long_gaps = [gap for gap in gaps if gap > 20_000]
        region_ms = (decode[-1][2] - decode[0][1]) / 1e6
        result.update(
            step_ms=step_ms,
            profiled_step_ms=region_ms / steps,
            busy_ms=busy_ns(decode) / 1e6 / steps,
            kernels_per_step=len(decode) / steps,
            gaps_over_20us_per_step=len(long_gaps) / steps,
            gaps_over_20us_ms=sum(long_gaps) / 1e6 / steps,
            kinds_ms={k: v / 1e6 / steps for k, v in by_kind.most_common()},
            top=[
                {"name": n[:90], "per_step": c / steps, "us": t / c / 1e3, "ms_per_step": t / 1e6 / steps}
                for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.top]
            ],
            host=[  # events nest: a caller's time includes its callees'
                {"name": n[:90], "per_step": c / steps, "ms_per_step": t / 1e6 / steps}
                for n, (c, t) in sorted(host.items(), key=lambda kv: -kv[1][1])[: 2 * args.top]
            ],
        )
        counters = torch._dynamo.utils.counters
        result["counters"] = {
            "stats": dict(counters["stats"]),
            "graph_break": dict(counters["graph_break"]),
            "inductor": {k: v for k, v in counters["inductor"].items() if "graph" in k or "partition" in k},
        }
        result["projections_alone_ms"] = projections_alone_us(model, args.batch) / 1e3
    del model
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--moe", action="store_true", help="the Qwen3-MoE at Qwen3-30B-A3B dimensions")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--who", nargs="+", default=["bf16", "mxgemm"], help="the models, in this order")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for who in args.who:
        row = anatomy(who, args)
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                          indent=1)  # fmt: skip
    print("| who | step ms | profiled step ms | GPU busy ms | gaps > 20 µs ms | kernels | projections alone ms "
          "| kinds ms |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in r["kinds_ms"].items())
        print(f"| {r['who']} | {r['step_ms']:.2f} | {r['profiled_step_ms']:.2f} | {r['busy_ms']:.2f} | "
              f"{r['gaps_over_20us_ms']:.2f} | {r['kernels_per_step']:.0f} | {r['projections_alone_ms']:.2f} "
              f"| {kinds} |")  # fmt: skip


if __name__ == "__main__":
    main()
