"""A whole model as a user runs it: a Hugging Face Llama at Llama-3-8B dimensions (32 layers, random weights) or, with
``--moe``, a Qwen3-MoE at Qwen3-30B-A3B dimensions (48 layers, 128 experts, top-8; bf16 experts on transformers'
``grouped_mm`` implementation, mxgemm's on ``MXFP8Experts``), through ``generate``, bf16 against mxgemm
(``quantize_model``), eager and compiled with CUDA graphs, in one run.

For each (mode, batch) and each of bf16 and mxgemm: a 512-token prompt, time to first token (``generate`` of one
token), decode tokens/s (128 new tokens: batch x 127 tokens over the time past the first token), a 2048-token prefill
(batch 1, one token), the bytes of the model's tensors on the GPU (each storage once) and its peak: those bytes, what
its earlier calls keep allocated (a static cache, CUDA graph pools) and the most one of its calls allocates beyond.
Greedy, EOS ignored. ``graphs``: ``generate`` with a static cache and Hugging Face's automatic compilation of the
decode step (``torch.compile``, ``mode="reduce-overhead"``: CUDA graphs). Each model's first call of each kind per
(mode, batch) is untimed (compilation, and a first call of a kind taking longer than the next ones).

Both models live in one process and their calls alternate, the order swapped every round, each figure the median of
its rounds (``--eager-repeats``, 9, eager; ``--repeats``, 5, with graphs): the host's drift between minutes (eager
``generate`` times have moved by 40% between runs) falls on both alike, and whatever one model's calls leave warm
(cuDNN's attention plans) the other's find warm too. Under the table, each round's decode speed-up of the pair run
back to back (its spread and median): where the host's speed moves within a run, the rounds' medians taken apart may
pair a fast round of one model with a slow one of the other. Eager rounds, bound by the host, get more of them.

Run on the device: PYTHONPATH=src python3 bench/model_e2e.py [--moe] --json e2e.json --markdown e2e.md
(``--tiny --device cpu`` runs the same script on a few-MB model: a smoke test, not a measurement.) The mxgemm model is
built first: its bf16 weights are freed as it is quantized, so the two models together peak at bf16's weights and
mxgemm's, not twice bf16's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
import transformers

import mxgemm
from mxgemm import settings
from mxgemm.bench import environment

WHO = ("bf16", "mxgemm")


def config(layers: int, tiny: bool, moe: bool):
    """The model's configuration: Llama-3-8B or (``moe``) Qwen3-30B-A3B dimensions, or a few-MB model of the kind."""
    if moe:
        dims = dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            vocab_size=151936,
        )
        if tiny:
            dims = dict(
                hidden_size=128,
                moe_intermediate_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                num_experts=8,
                num_experts_per_tok=2,
                vocab_size=512,
            )
        made = transformers.Qwen3MoeConfig(
            num_hidden_layers=layers, max_position_embeddings=8192, norm_topk_prob=True, rope_theta=1000000.0, **dims
        )
        made._experts_implementation = "grouped_mm"  # transformers' fastest bf16 experts on a GPU
        return made
    dims = dict(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256
    )
    if tiny:
        dims = dict(
            hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512
        )
    return transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=8192, rope_theta=500000.0, **dims)


def build(model_config, who: str, skip: tuple[str, ...], device: str = "cuda", fuse: bool = True):
    """(model, quantize report) for ``who`` on ``device``; ``fuse``: as for :func:`mxgemm.quantize_model`."""
    torch.manual_seed(0)
    with torch.device(device):
        # made in bf16: fp32 first would need twice the bytes (a 30B model: 122 GB before its bf16 copy)
        model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16).eval()
    model.requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    report = ""
    if who == "mxgemm":
        report = str(mxgemm.quantize_model(model, skip=skip, fuse=fuse))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model, report


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model keeps (parameters, buffers, prepared MX weights), each storage once."""
    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        if isinstance(module, mxgemm.MXFP8Linear):
            tensors += list(module.prepared.tensors.values())
        if isinstance(module, mxgemm.MXFP8Experts):
            tensors += [*module.gate_up.tensors.values(), *module.down.tensors.values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class Timer:
    """Wall time of ``generate`` calls (synchronized on a GPU) and what they allocate."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def generate(self, model, ids, new: int, **kwargs) -> tuple[float, int, int]:
        """(seconds, the most allocated above what was allocated before, what stays allocated after) of one
        ``generate`` of ``new`` tokens (bytes: 0 without a GPU)."""
        self.sync()
        before = torch.cuda.memory_allocated() if self.cuda else 0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kwargs)
        self.sync()
        seconds = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + new
        if not self.cuda:
            return seconds, 0, 0
        return seconds, torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before


def measure(models: dict, resident: dict, kept: dict, mode: str, batch: int, args, timer: Timer) -> list[dict]:
    """One row per model for (mode, batch), its calls alternating with the other model's. ``kept``: the bytes each
    model's calls so far keep allocated, updated."""
    eager = {"disable_compile": True}
    kwargs = eager
    if mode == "graphs":  # dynamic=False: one graph per batch size, never a dynamic-shape recompile
        kwargs = {"cache_implementation": "static", "compile_config": transformers.CompileConfig(dynamic=False)}
    device = next(iter(models.values())).device
    g = torch.Generator(device=device).manual_seed(batch)
    ids = torch.randint(1, args.vocab, (batch, args.prompt), device=device, generator=g)
    long_ids = torch.randint(1, args.vocab, (1, args.prefill), device=device, generator=g)
    times = {who: {"ttft": [], "full": [], "prefill": [], "peak": 0} for who in models}

    def run(who: str, key: str, ids, new: int, **kw) -> None:
        """One call of ``who``'s: its time under ``key``; its peak is the model's weights, what its calls keep (the
        static cache, graph pools: ``kept``) and the most this call allocates beyond them."""
        seconds, above, stays = timer.generate(models[who], ids, new, **kw)
        times[who]["peak"] = max(times[who]["peak"], resident[who] + kept[who] + above)
        kept[who] += stays
        if key:
            times[who][key].append(seconds)

    with torch.inference_mode() if args.grad_mode == "inference" else torch.no_grad():
        for who in models:  # warm-up: kernels built and plans made; graphs compiled, recorded and captured at this
            for _ in range(2 if mode == "graphs" else 1):  # cache length, which takes a second call
                run(who, "", ids, args.new, **kwargs)
            run(who, "", ids, 1, **kwargs)  # each call the rounds time, once: a first one of a kind takes longer
            run(who, "", long_ids, 1, **eager)
        for r in range(args.eager_repeats if mode == "eager" else args.repeats):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            for who in order:
                run(who, "ttft", ids, 1, **kwargs)
                run(who, "full", ids, args.new, **kwargs)
                # the prefill runs eagerly in both modes (Hugging Face compiles the decode step only)
                run(who, "prefill", long_ids, 1, **eager)
    rows = []
    for who, t in times.items():
        ttft, full, prefill = (statistics.median(t[k]) for k in ("ttft", "full", "prefill"))
        rows.append(
            {
                "who": who,
                "mode": mode,
                "batch": batch,
                "weights_bytes": resident[who],
                "decode_tok_s": batch * (args.new - 1) / (full - ttft),
                "ttft_ms": ttft * 1e3,
                "prefill_2048_ms": prefill * 1e3,
                "generate_s": full,
                "peak_bytes": t["peak"],
                "rounds_s": {k: t[k] for k in ("ttft", "full", "prefill")},  # every round's time: the medians' spread
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, help="decoder layers (default: 32, or 48 with --moe)")
    parser.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B dimensions instead of Llama-3-8B's")
    parser.add_argument("--modes", nargs="+", default=["eager", "graphs"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--skip", nargs="*", default=[], help="layers quantize_model leaves in bf16 (e.g. lm_head)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of the graphs rows")
    parser.add_argument(
        "--eager-repeats",
        type=int,
        default=9,
        help="rounds of the eager rows (host-bound: more rounds, a steadier median)",
    )
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=128, help="new tokens of the decode measurement")
    parser.add_argument("--prefill", type=int, default=2048, help="tokens of the prefill measurement")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a few-MB model: a smoke test of this script")
    parser.add_argument("--no-fuse", action="store_true", help="each projection a GEMM of its own (fuse=False)")
    parser.add_argument(
        "--grad-mode",
        choices=("inference", "no_grad"),
        default="inference",
        help="the calls under torch.inference_mode (default) or torch.no_grad, as generate alone runs them",
    )
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    args.layers = args.layers or (48 if args.moe else 32)
    device = torch.device(args.device)
    env = environment(mxgemm.describe_device(device))
    models, reports, resident = {}, {}, {}
    model_config = config(args.layers, args.tiny, args.moe)
    for who in reversed(WHO):  # mxgemm first: its bf16 weights are gone before bf16's model is made
        models[who], reports[who] = build(model_config, who, tuple(args.skip), args.device, not args.no_fuse)
        resident[who] = weights_bytes(models[who])
        print(who, reports[who], f"weights {resident[who] / 2**30:.2f} GiB", flush=True)
    models = {who: models[who] for who in WHO}
    args.vocab = models["bf16"].config.vocab_size
    timer = Timer(device)
    kept = dict.fromkeys(WHO, 0)
    rows: list[dict] = []
    for mode in args.modes:
        for batch in args.batches:
            rows += measure(models, resident, kept, mode, batch, args, timer)
            for row in rows[-len(WHO) :]:
                print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    meta = {
                        "device": env,
                        "model": model_name(args),
                        "layers": args.layers,
                        "prompt": args.prompt,
                        "new_tokens": args.new,
                        "prefill_tokens": args.prefill,
                        "skip": args.skip,
                        "fuse": not args.no_fuse,
                        "eager_graphs": settings.eager_graphs_enabled(),
                        "grad_mode": args.grad_mode,
                        "order": "interleaved",
                        "quantize_report": reports,
                    }
                    json.dump({**meta, "rows": rows}, f, indent=1)
    table = markdown(rows, args, env)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)


def paired_speedups(bf16: dict, mx: dict) -> list[float]:
    """Each round's decode speed-up (bf16's decode time over mxgemm's, decode time being `generate`'s less its first
    token's): the two ran back to back, so a drift of the host's speed between rounds moves both."""
    decode = [
        [full - ttft for full, ttft in zip(r["rounds_s"]["full"], r["rounds_s"]["ttft"], strict=True)]
        for r in (bf16, mx)
    ]
    return [b / m for b, m in zip(*decode, strict=True)]


def pooled_prefill(rows: list[dict]) -> tuple[float, float, list[float]]:
    """The prefill over every round of the run: it is one eager call of the same prompt in every row, so all rows'
    rounds time one thing. bf16's and mxgemm's medians (seconds) and each round's speed-up (bf16's time over
    mxgemm's, the two run back to back)."""
    by = {(r["who"], r["mode"], r["batch"]): r["rounds_s"]["prefill"] for r in rows}
    keys = [(mode, batch) for who, mode, batch in by if who == "mxgemm" and ("bf16", mode, batch) in by]
    bf16 = [t for k in keys for t in by[("bf16", *k)]]
    mx = [t for k in keys for t in by[("mxgemm", *k)]]
    return statistics.median(bf16), statistics.median(mx), [b / m for b, m in zip(bf16, mx, strict=True)]


def model_name(args) -> str:
    kind, dims = ("Qwen3-MoE", "Qwen3-30B-A3B") if args.moe else ("Llama", "Llama-3-8B")
    return f"{kind} at {'tiny' if args.tiny else dims} dimensions"


def markdown(rows: list[dict], args, env) -> str:
    by = {(r["who"], r["mode"], r["batch"]): r for r in rows}
    graphs_note = (
        "; the experts' eager calls replay CUDA graphs"
        if settings.eager_graphs_enabled()
        else ("; the experts' eager calls launch directly (MXGEMM_EAGER_GRAPHS=0)")
    )
    lines = [
        f"{model_name(args)}, {args.layers} layers, random weights, Hugging "
        f"Face `generate` (greedy, {args.prompt}-token prompt, {args.new} new tokens; bf16 and mxgemm calls "
        f"alternating, medians of {args.eager_repeats} rounds eager, {args.repeats} with graphs; under "
        f"`torch.{'inference_mode' if args.grad_mode == 'inference' else 'no_grad'}`); mxgemm quantizes "
        f"every linear layer{' and the experts (not the routers)' if args.moe else ''}"
        f"{' but ' + ', '.join(args.skip) if args.skip else ''}"
        f"{graphs_note if args.moe else ''}. {env}",
        "",
        "| mode | batch | bf16 tok/s | mxgemm tok/s | speedup | bf16 TTFT ms | mxgemm TTFT ms | bf16 prefill "
        f"{args.prefill} ms | mxgemm prefill {args.prefill} ms | prefill speedup | weights GiB bf16 / mxgemm "
        "| peak GiB bf16 / mxgemm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    pairs = []
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
        ratios = paired_speedups(b, m)
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}x"
        pairs.append(f"{mode} at batch {batch}: {spread}, median {statistics.median(ratios):.2f}x")
    lines += ["", "Decode speed-up of each round's pair, run back to back: " + "; ".join(pairs) + "."]
    if pairs:
        bf16, mx, ratios = pooled_prefill(rows)
        lines += [
            "",
            f"The {args.prefill}-token prefill over all {len(ratios)} rounds of each model (one eager call "
            f"every round): bf16 {bf16 * 1e3:.1f} ms, mxgemm {mx * 1e3:.1f} ms, {bf16 / mx:.2f}x the medians; "
            f"each round's pair {min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.2f}x.",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
