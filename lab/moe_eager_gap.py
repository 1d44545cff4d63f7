"""Where the eager one-token decode of the MoE e2e's model goes, bf16 against mxgemm, in one process: why a decoder
layer called back to back saves about a third of bf16's host time while ``generate`` saves a tenth.

For each grad mode (``torch.inference_mode``, as bench/model_e2e.py runs, and ``torch.no_grad``, as
lab/moe_layer_host.py did) and each model: layer 0's parts called back to back (lab/moe_layer_host.py's ``parts``),
``generate``'s ms a decode token (a 512-token prompt; the ``--new``-token call less the one-token call, median,
least and most of 5 pairs, the models alternating), the CUDA kernels a decode token launches (the profiler's count,
same difference), and each part's host ms a decode token inside ``generate`` (forward hooks on every layer's parts
down to the MoE block, a run of its own).
mxgemm once more with its MoE blocks run as before mxgemm.moe_blocks (the experts' own graphs alone), then also
its attentions as before mxgemm.attention (q/k/v apart under inference_mode), then with ``MXGEMM_EAGER_GRAPHS=0``.

Run on the device: PYTHONPATH=src python3 lab/moe_eager_gap.py [--layers 24] --json gap.json
(``--tiny`` runs it on a few-MB model on the CPU: a smoke test of the script, not a measurement.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_layer_host
from model_e2e import build, config

from mxgemm.attention import is_vouched_attention
from mxgemm.moe_blocks import is_graphed_block

MODES = {"inference": torch.inference_mode, "no_grad": torch.no_grad}


def generate_s(model, ids, new: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, disable_compile=True)
    sync()
    return time.perf_counter() - t0


def decode_ms(models: dict, ids, new: int, sync, pairs: int = 5) -> dict[str, dict[str, float]]:
    """ms a decode token of each model: the ``new``-token call less the one-token call, the median, least and most of
    ``pairs`` pairs, the models alternating (one run's medians of 3 swung by 2x between grad modes)."""
    out = defaultdict(list)
    for _ in range(pairs):
        for who, model in models.items():
            many, one = generate_s(model, ids, new, sync), generate_s(model, ids, 1, sync)
            out[who].append((many - one) * 1e3 / (new - 1))
    return {who: {"median": statistics.median(v), "min": min(v), "max": max(v)} for who, v in out.items()}


def kernels_a_token(model, ids, new: int, device: str) -> float:
    """CUDA kernels (and memcpys/memsets) a decode token launches."""
    if device != "cuda":
        return 0.0
    counts = []
    for n in (new, 1):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, disable_compile=True)
            torch.cuda.synchronize()
        counts.append(sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA))
    return (counts[0] - counts[1]) / (new - 1)


def hooked_parts(model, ids, new: int, sync) -> dict[str, float]:
    """Host ms a decode token by part inside ``generate`` (forward hooks; the hooks' own time included)."""
    timed: dict[str, float] = defaultdict(float)
    started: dict[int, float] = {}
    names: dict[int, str] = {}
    handles = []

    def before(module, _args):
        started[id(module)] = time.perf_counter()

    def after(module, _args, _out):
        timed[names[id(module)]] += time.perf_counter() - started[id(module)]

    def watch(module, name: str) -> None:
        names[id(module)] = name
        handles.extend((module.register_forward_pre_hook(before), module.register_forward_hook(after)))

    watch(model.model, "model")
    for layer in model.model.layers:
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            watch(getattr(layer, name), name)
        watch(layer, "decoder layer")  # none inside the MoE block: a hook there runs a graphed block directly
    try:
        runs = []
        for n in (new, 1, new, 1, new, 1):
            timed.clear()
            wall = generate_s(model, ids, n, sync)
            runs.append({"generate": wall, **timed})
        pairs = list(zip(runs[::2], runs[1::2], strict=True))
        per_token = [{name: (a[name] - b.get(name, 0.0)) * 1e3 / (new - 1) for name in a} for a, b in pairs]
        return {name: statistics.median(p[name] for p in per_token) for name in runs[0]}
    finally:
        for handle in handles:
            handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--new", type=int, default=33)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    moe_layer_host.DEVICE = device
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    cfg = config(args.layers, tiny=args.tiny, moe=True)
    models = {who: build(cfg, who, (), device=device)[0] for who in ("mxgemm", "bf16")}
    ids = torch.randint(1, 500, (1, 512), device=device, generator=torch.Generator(device).manual_seed(0))
    doc: dict = {"layers": args.layers, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    for mode, context in MODES.items():
        with context():
            for model in models.values():  # warm: plans made, graphs captured, cuDNN's attention planned
                moe_layer_host.parts(model, 1)
                decode_ms({"w": model}, ids, 5, sync, pairs=1)
            row = {"decode ms a token": decode_ms(models, ids, args.new, sync)}
            row["kernels a token"] = {w: kernels_a_token(m, ids, 9, device) for w, m in models.items()}
            row["back to back µs"] = {w: moe_layer_host.parts(m, 1) for w, m in models.items()}
            row["hooked ms a token"] = {w: hooked_parts(m, ids, args.new, sync) for w, m in models.items()}
            doc[mode] = row
    mxgemm_model = models["mxgemm"]
    undo = {  # each step back to the model before it, in turn: the blocks' own classes, then the attentions'
        "inference, blocks not graphed": is_graphed_block,
        "inference, neither blocks graphed nor attention vouched": is_vouched_attention,
    }
    for label, taken in undo.items():
        for module in mxgemm_model.modules():
            if taken(module):
                module.__class__ = type(module).__mro__[1]
        with torch.inference_mode():
            mx = {"mxgemm": mxgemm_model}
            decode_ms(mx, ids, 5, sync, pairs=1)
            doc[label] = {
                "decode ms a token": decode_ms(mx, ids, args.new, sync),
                "kernels a token": {"mxgemm": kernels_a_token(mxgemm_model, ids, 9, device)},
                "back to back µs": {"mxgemm": moe_layer_host.parts(mxgemm_model, 1)},
            }
    os.environ["MXGEMM_EAGER_GRAPHS"] = "0"
    with torch.inference_mode():
        mx = {"mxgemm": models["mxgemm"]}
        decode_ms(mx, ids, 5, sync, pairs=1)
        doc["inference, MXGEMM_EAGER_GRAPHS=0"] = {
            "decode ms a token": decode_ms(mx, ids, args.new, sync),
            "kernels a token": {"mxgemm": kernels_a_token(models["mxgemm"], ids, 9, device)},
        }
    del os.environ["MXGEMM_EAGER_GRAPHS"]
    print(f"{doc['device']}, {args.layers} layers, batch 1, eager")
    for mode in (*MODES, *undo, "inference, MXGEMM_EAGER_GRAPHS=0"):
        print(f"== {mode}")
        for what, by_who in doc[mode].items():
            for who, value in by_who.items():
                if isinstance(value, dict):
                    text = ", ".join(f"{k} {v:.3f}" if "ms" in what else f"{k} {v:.1f}" for k, v in value.items())
                else:
                    text = f"{value:.3f}" if "ms" in what else f"{value:.1f}"
                print(f"{what:20s} {who:7s} {text}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
