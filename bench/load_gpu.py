"""Loading an MXFP8 checkpoint of a Llama at Llama-3-8B dimensions onto the GPU: wall time, peak GPU memory against
the final footprint, and peak host memory. The checkpoint is written first by ``mxgemm.convert.quantize_folder`` from
a synthetic bf16 source (random weights, one shard per layer); the model is built with its parameters on the meta
device (``accelerate.init_empty_weights``) and loaded with ``load_checkpoint(device="cuda")``.

Run on the device: PYTHONPATH=src python3 bench/load_gpu.py --json load-gpu-h200.json
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import accelerate
import torch
import transformers
from safetensors.torch import save_file

import mxgemm
from mxgemm.bench import environment
from mxgemm.convert import quantize_folder


def make_source(folder: Path, layers: int) -> transformers.LlamaConfig:
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    by_layer: dict[str, dict] = {}
    for name, shape in shapes.items():
        part = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        by_layer.setdefault(part, {})[name] = shape
    for part, group in by_layer.items():
        tensors = {n: (torch.randn(s, device="cuda", generator=g) * 0.02).bfloat16().cpu() for n, s in group.items()}
        save_file(tensors, str(folder / f"part-{part}.safetensors"), metadata={"format": "pt"})
    return config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "mx"
        src.mkdir()
        out.mkdir()
        config = make_source(src, args.layers)
        t0 = time.perf_counter()
        quantize_folder(src, out, skip=(), device="cuda", max_shard_bytes=2 * 10**9)
        quantize_s = time.perf_counter() - t0
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        host_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with accelerate.init_empty_weights():
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        t0 = time.perf_counter()
        report = mxgemm.load_checkpoint(model, out, device="cuda")
        torch.cuda.synchronize()
        load_s = time.perf_counter() - t0
        final = torch.cuda.memory_allocated() - before
        peak = torch.cuda.max_memory_allocated() - before
        row = {
            "layers": args.layers, "quantized_layers": len(report.quantized), "quantize_s": quantize_s,
            "load_s": load_s, "final_gpu_bytes": final, "peak_gpu_bytes": peak, "peak_over_final": peak / final,
            "host_peak_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - host_before) * 1024,
            "backend": next(m.backend for m in model.modules() if isinstance(m, mxgemm.MXFP8Linear)),
        }  # fmt: skip
    print(json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": environment(mxgemm.describe_device()), "row": row}, f, indent=1)


if __name__ == "__main__":
    main()
