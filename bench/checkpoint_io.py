"""Checkpoint I/O at size, on the CPU: quantizing a bf16 model folder to MXFP8 and loading the result, with wall time,
throughput and peak resident memory above each process's baseline (its imports), each run in a fresh process.

- quantize, before: the whole model built with ``from_pretrained``, ``quantize_model``, ``save_checkpoint`` (what
  ``mxgemm quantize`` did until it streamed);
- quantize, now: ``mxgemm.convert.quantize_folder`` (tensor by tensor, shards of 500 MB);
- load, model built in bf16 first: ``from_config`` on the CPU, then ``load_checkpoint``;
- load, parameters on meta: ``accelerate.init_empty_weights()``, then ``load_checkpoint(device="cpu")``.

The source is a synthetic Llama-shaped bf16 checkpoint of about ``--gb`` GB in one shard per layer, random weights.
Tensors loaded to the CPU stay backed by the files' pages (safetensors maps the files), so a load to the CPU reads
little until the weights are used; a load to a GPU copies every byte.

Run: PYTHONPATH=src python3 bench/checkpoint_io.py --gb 2 --json checkpoint-io-cpu.json --markdown checkpoint-io-cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from mxgemm.models import hf_meta_model

HIDDEN, INTER = 2048, 5632


def write_source(folder: Path, config, device: str = "cpu") -> int:
    """A bf16 checkpoint of ``config``'s model with random weights (normal, std 0.02), one shard per decoder layer
    and one for the rest, with an index, written without building the model (names and shapes come from a model
    built on the meta device; ``device`` draws the numbers); its bytes."""
    config.save_pretrained(folder)
    shapes = {k: v.shape for k, v in hf_meta_model(config).state_dict().items()}
    groups: dict[str, dict] = {}
    for name, shape in shapes.items():
        groups.setdefault(name.split(".")[2] if name.startswith("model.layers.") else "rest", {})[name] = shape
    g = torch.Generator(device=device).manual_seed(0)
    total, weight_map = 0, {}
    for i, group in enumerate(groups.values()):
        tensors = {n: (torch.randn(s, device=device, generator=g) * 0.02).bfloat16().cpu() for n, s in group.items()}
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.numel() * 2 for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def make_source(folder: Path, gb: float) -> int:
    """A Llama-shaped bf16 checkpoint of about ``gb`` GB; returns its bytes."""
    per_layer = 2 * (2 * HIDDEN * HIDDEN + 2 * (HIDDEN // 4) * HIDDEN + 3 * INTER * HIDDEN)
    layers = max(1, round(gb * 1e9 / per_layer))
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    return write_source(folder, config)


def measure(body: str) -> dict:
    """Run ``body`` in a fresh process after its imports; its wall time and peak RSS above the imports' peak."""
    script = (
        textwrap.dedent("""
        import resource, time
        from pathlib import Path
        import accelerate, torch, transformers, mxgemm, mxgemm.convert
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
    """)
        + textwrap.dedent(body)
        + textwrap.dedent("""
        print(time.perf_counter() - t0, base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """)
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    seconds, base, peak = done.stdout.split()[-3:]
    return {"seconds": float(seconds), "peak_rss_above_baseline": (int(peak) - int(base)) * 1024}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, old, new = Path(tmp) / "src", Path(tmp) / "old", Path(tmp) / "new"
        for d in (src, old, new):
            d.mkdir()
        total = make_source(src, args.gb)
        cases = {
            "quantize, before (whole model)": f"""
                model = transformers.AutoModelForCausalLM.from_pretrained({str(src)!r}, dtype="auto")
                mxgemm.quantize_model(model, backend="emulation")
                mxgemm.save_checkpoint(model, {str(old)!r}, config=model.config.to_dict())
            """,
            "quantize, now (streaming)": f"""
                mxgemm.convert.quantize_folder(Path({str(src)!r}), Path({str(new)!r}), max_shard_bytes=500 * 10**6)
            """,
            "load, model built in bf16 first": f"""
                config = transformers.AutoConfig.from_pretrained({str(new)!r})
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
                mxgemm.load_checkpoint(model, {str(new)!r}, backend="emulation")
            """,
            "load, parameters on meta": f"""
                config = transformers.AutoConfig.from_pretrained({str(new)!r})
                with accelerate.init_empty_weights():
                    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
                mxgemm.load_checkpoint(model, {str(new)!r}, backend="emulation", device="cpu")
            """,
        }
        rows = []
        for name, body in cases.items():
            row = {"case": name, "source_bytes": total} | measure(body)
            row["gb_per_s"] = total / row["seconds"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
    env = {"torch": torch.__version__, "transformers": transformers.__version__, "cpu_count": os.cpu_count()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)
    lines = [f"Checkpoint I/O on the CPU, a {total / 1e9:.2f} GB bf16 Llama-shaped source; {env}", "",
             "| case | seconds | GB/s (source bytes) | peak RSS above baseline, GB |", "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['case']} | {r['seconds']:.1f} | {r['gb_per_s']:.2f} | "
                     f"{r['peak_rss_above_baseline'] / 1e9:.2f} |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(
            table + "\nCommand: `PYTHONPATH=src python3 bench/checkpoint_io.py --gb "
            f"{args.gb:g} --json checkpoint-io-cpu.json --markdown checkpoint-io-cpu.md`\n"
        )


if __name__ == "__main__":
    main()
