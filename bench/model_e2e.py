"""A whole model as a user runs it: a Hugging Face Llama at Llama-3-8B dimensions (32 layers, random weights) through
``generate``, bf16 against mxgemm (``quantize_model``), eager and compiled with CUDA graphs, in one run.

For each (who, mode, batch): a 512-token prompt, time to first token (``generate`` of one token), decode tokens/s
(128 new tokens: batch x 127 tokens over the time past the first token), a 2048-token prefill (batch 1, one token),
the bytes of the model's tensors on the GPU (each storage once) and the peak of the caching allocator. Greedy, EOS
ignored. ``graphs``: ``generate`` with a static cache and Hugging Face's automatic compilation of the decode step
(``torch.compile``, ``mode="reduce-overhead"``: CUDA graphs), its first call per batch size (compilation) untimed.
Each of bf16 and mxgemm runs in a process of its own (caches one leaves warm, such as cuDNN's attention plans, would
favour the other). Rows are written as they are measured.

Run on the device: PYTHONPATH=src python3 bench/model_e2e.py --json e2e.json --markdown e2e.md
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

import mxgemm
from mxgemm.bench import environment

PROMPT, NEW, PREFILL = 512, 128, 2048


def build(layers: int, who: str, skip: tuple[str, ...]) -> tuple[torch.nn.Module, str]:
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    report = ""
    if who == "mxgemm":
        report = str(mxgemm.quantize_model(model, skip=skip))
    gc.collect()
    torch.cuda.empty_cache()
    return model, report


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model keeps on the GPU (parameters, buffers, prepared MX weights), each storage
    once."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if isinstance(module, mxgemm.MXFP8Linear):
            tensors += list(module.prepared.tensors.values())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.is_cuda}
    return sum(storages.values())


def timed_generate(model, ids, new: int, **kwargs) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new
    return time.perf_counter() - t0


def measure(model, mode: str, batch: int, repeats: int) -> dict:
    eager = {"disable_compile": True}
    kwargs = eager
    if mode == "graphs":  # dynamic=False: one graph per batch size, never a dynamic-shape recompile
        kwargs = {"cache_implementation": "static", "compile_config": transformers.CompileConfig(dynamic=False)}
    g = torch.Generator(device="cuda").manual_seed(batch)
    ids = torch.randint(100, 120000, (batch, PROMPT), device="cuda", generator=g)
    long_ids = torch.randint(100, 120000, (1, PREFILL), device="cuda", generator=g)
    with torch.inference_mode():
        for _ in range(2):  # warm-up: kernels built; graphs compiled, recorded and captured at this cache length
            timed_generate(model, ids, NEW, **kwargs)
        ttft = statistics.median(timed_generate(model, ids, 1, **kwargs) for _ in range(repeats))
        full = statistics.median(timed_generate(model, ids, NEW, **kwargs) for _ in range(max(repeats - 1, 1)))
        # the prefill runs eagerly in both modes (Hugging Face compiles the decode step only)
        timed_generate(model, long_ids, 1, **eager)
        prefill = statistics.median(timed_generate(model, long_ids, 1, **eager) for _ in range(repeats))
    return {
        "decode_tok_s": batch * (NEW - 1) / (full - ttft),
        "ttft_ms": ttft * 1e3,
        "prefill_2048_ms": prefill * 1e3,
        "generate_s": full,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--who", nargs="+", default=["bf16", "mxgemm"])
    parser.add_argument("--modes", nargs="+", default=["eager", "graphs"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--skip", nargs="*", default=[], help="layers quantize_model leaves in bf16 (e.g. lm_head)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    env = environment(mxgemm.describe_device())
    rows: list[dict] = []
    reports = {}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": env, "layers": args.layers, "prompt": PROMPT, "new_tokens": NEW,
                           "skip": args.skip, "quantize_report": reports, "rows": rows}, f, indent=1)  # fmt: skip

    if len(args.who) > 1:  # one process each: no cache one leaves warm (cuDNN attention plans, ...) helps the other
        for who in args.who:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "rows.json"
                argv = _without(sys.argv[1:], ("--who", "--json", "--markdown"))
                child = [sys.executable, __file__, *argv, "--who", who,
                         "--json", str(out)]  # fmt: skip
                subprocess.run(child, check=True)
                part = json.loads(out.read_text())
            rows += part["rows"]
            reports |= part["quantize_report"]
            save()
    for who in args.who if len(args.who) == 1 else ():
        model, reports[who] = build(args.layers, who, tuple(args.skip))
        resident = weights_bytes(model)
        print(who, reports[who], f"weights {resident / 2**30:.2f} GiB", flush=True)
        for mode in args.modes:
            for batch in args.batches:
                torch.cuda.reset_peak_memory_stats()
                row = {"who": who, "mode": mode, "batch": batch, "weights_bytes": resident}
                row |= measure(model, mode, batch, args.repeats)
                row["peak_bytes"] = torch.cuda.max_memory_allocated()
                rows.append(row)
                print(json.dumps(row), flush=True)
                save()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    table = markdown(rows, args, env)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without the given options and their values."""
    kept, skipping = [], False
    for a in argv:
        if a.startswith("--"):
            skipping = a in options
        if not skipping:
            kept.append(a)
    return kept


def markdown(rows: list[dict], args, env) -> str:
    by = {(r["who"], r["mode"], r["batch"]): r for r in rows}
    lines = [
        f"Llama at Llama-3-8B dimensions, {args.layers} layers, random weights, Hugging Face `generate` (greedy, "
        f"{PROMPT}-token prompt, {NEW} new tokens); mxgemm quantizes every linear layer"
        f"{' but ' + ', '.join(args.skip) if args.skip else ''}. {env}",
        "",
        "| mode | batch | bf16 tok/s | mxgemm tok/s | speedup | bf16 TTFT ms | mxgemm TTFT ms | bf16 prefill 2048 ms "
        "| mxgemm prefill 2048 ms | prefill speedup | weights GiB bf16 / mxgemm | peak GiB bf16 / mxgemm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (who, mode, batch), m in by.items():
        b = by.get(("bf16", mode, batch))
        if who != "mxgemm" or b is None:
            continue
        gib = 2**30
        lines.append(
            f"| {mode} | {batch} | {b['decode_tok_s']:.1f} | {m['decode_tok_s']:.1f} | "
            f"{m['decode_tok_s'] / b['decode_tok_s']:.2f} | {b['ttft_ms']:.1f} | {m['ttft_ms']:.1f} | "
            f"{b['prefill_2048_ms']:.1f} | {m['prefill_2048_ms']:.1f} | "
            f"{b['prefill_2048_ms'] / m['prefill_2048_ms']:.2f} "
            f"| {b['weights_bytes'] / gib:.2f} / {m['weights_bytes'] / gib:.2f} "
            f"| {b['peak_bytes'] / gib:.2f} / {m['peak_bytes'] / gib:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
