"""End-to-end model timing on a GPU: a Llama-architecture model at 8B dimensions (a few layers, random weights),
bf16 vs mxgemm, each compiled and CUDA-graph captured. Prefill of 2048 tokens and one decode step (16 sequences).

Run on the device: PYTHONPATH=src python3 bench/model_e2e.py --layers 4 --json e2e.json --markdown e2e.md
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import transformers

import mxgemm
from mxgemm.bench import environment


def build(layers: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    for p in model.parameters():  # init_weights' std 0.02 everywhere: fine for timing
        p.requires_grad_(False)
    return model


def graph_time(fn, x, replays: int = 20) -> float:
    """Median ms of one call of ``fn(x)`` replayed from a CUDA graph, after warm-up."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    rows = []
    for variant in ("bf16", "mxgemm"):
        model = build(args.layers)
        report = None
        if variant == "mxgemm":
            report = mxgemm.quantize_model(model)
        body = model.model  # the decoder stack: no lm_head, no sampling
        compiled = torch.compile(lambda x, body=body: body(inputs_embeds=x, use_cache=False).last_hidden_state)
        with torch.no_grad():
            for phase, shape in (("prefill", (1, 2048)), ("decode", (16, 1))):
                x = torch.randn(*shape, 4096, device="cuda", dtype=torch.bfloat16)
                ms = graph_time(compiled, x)
                rows.append({"variant": variant, "phase": phase, "batch": shape[0], "tokens": shape[1], "ms": ms})
                print(rows[-1], flush=True)
        if report is not None:
            print(report)
        del model, body, compiled
        torch.cuda.empty_cache()
    env = environment(mxgemm.describe_device())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": env, "layers": args.layers, "rows": rows}, f, indent=1)
    if args.markdown:
        by = {(r["variant"], r["phase"]): r["ms"] for r in rows}
        lines = [f"Llama 8B dimensions, {args.layers} layers, compiled + CUDA graph; {env}", "",
                 "| phase | bf16 ms | mxgemm ms | speedup |", "|---|---|---|---|"]  # fmt: skip
        for phase in ("prefill", "decode"):
            b, m = by[("bf16", phase)], by[("mxgemm", phase)]
            lines.append(f"| {phase} | {b:.3f} | {m:.3f} | {b / m:.2f} |")
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
