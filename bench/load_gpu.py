"""Loading an MXFP8 checkpoint of a Llama at Llama-3-8B dimensions onto the GPU: wall time, peak GPU memory against
the final footprint, and peak host memory. The checkpoint is written first by ``mxgemm.convert.quantize_folder`` from
a synthetic bf16 source (random weights, one shard per layer); then a fresh process builds the model with its
parameters on the meta device (``accelerate.init_empty_weights``) and loads it with
``load_checkpoint(device="cuda")``, its host figure measured from after CUDA's initialisation.

Run on the device: PYTHONPATH=src python3 bench/load_gpu.py --json load-gpu-h200.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import accelerate
import torch
import transformers

import mxgemm
from mxgemm.bench import environment
from mxgemm.convert import quantize_folder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_io import write_source


def llama_8b_config(layers: int) -> transformers.LlamaConfig:
    config = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    return config


def load(folder: Path) -> dict:
    """Load the checkpoint in ``folder`` into a meta-device model (this process: CUDA already initialised, so the
    host figure is what the load adds): wall time, GPU peak against the final footprint, host peak growth."""
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.zeros(1, device="cuda")  # the CUDA context, before the baselines
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    host_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with accelerate.init_empty_weights():
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    t0 = time.perf_counter()
    report = mxgemm.load_checkpoint(model, folder, device="cuda")
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    final = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    return {
        "layers": config.num_hidden_layers, "quantized_layers": len(report.quantized), "load_s": load_s,
        "final_gpu_bytes": final, "peak_gpu_bytes": peak, "peak_over_final": peak / final,
        "host_peak_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - host_before) * 1024,
        "checkpoint_bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
        "backend": next(m.backend for m in model.modules() if isinstance(m, mxgemm.MXFP8Linear)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json")
    parser.add_argument("--load-only", type=Path, help="load this checkpoint and print the figures (a fresh process)")
    args = parser.parse_args()
    if args.load_only:
        print(json.dumps(load(args.load_only)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "src", Path(tmp) / "mx"
        src.mkdir()
        out.mkdir()
        config = llama_8b_config(args.layers)
        write_source(src, config, device="cuda")
        t0 = time.perf_counter()
        quantize_folder(src, out, skip=(), device="cuda", max_shard_bytes=2 * 10**9)
        quantize_s = time.perf_counter() - t0
        done = subprocess.run([sys.executable, __file__, "--load-only", str(out)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
        row = {"quantize_s": quantize_s, **json.loads(done.stdout.splitlines()[-1])}
    print(json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": environment(mxgemm.describe_device()), "row": row}, f, indent=1)


if __name__ == "__main__":
    main()
