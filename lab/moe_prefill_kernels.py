"""The MoE e2e's eager 2048-token prefill taken apart: its wall time against the host's time to issue it (the call's
return, unsynchronised), the host time of each part of a decoder layer (forward hooks, summed over the layers), and GPU
time per kernel name over a few prefills.

bench/model_e2e.py's Qwen3-30B-A3B-shaped model (``--layers`` of them) is built from the mxgemm package on the path,
with that tree's bench/model_e2e.py, so the same script takes apart any commit's tree (PYTHONPATH=<tree>/src).

Run on the device: PYTHONPATH=<tree>/src python3 lab/moe_prefill_kernels.py --layers 24 --json kernels.json
"""

import argparse
import cProfile
import importlib.util
import io
import json
import pstats
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import torch

import mxgemm


def tree_commit() -> str:
    """The commit of the tree whose mxgemm is imported (its checkout's HEAD), and whether its files differ from it."""
    root = Path(mxgemm.__file__).resolve().parents[2]
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return f"the tree at {head or 'an unknown commit'}{' with changes' if dirty.stdout.strip() else ''}"


def e2e_module():
    """The bench/model_e2e.py of the tree whose mxgemm is imported."""
    path = Path(mxgemm.__file__).resolve().parents[2] / "bench" / "model_e2e.py"
    spec = importlib.util.spec_from_file_location("model_e2e", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host_us(fn, sync, n: int = 20) -> float:
    """µs of host time a call: ``n`` calls back to back, timed until the last returns (before synchronising)."""
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    seconds = time.perf_counter() - t0
    sync()
    return seconds / n * 1e6


def decode_parts(model, ids, new: int, parts: dict, timing: list, sync) -> dict[str, float]:
    """Eager ``generate`` of ``new`` tokens less that of one token (the 512-token prompt's prefill in both), each part's
    host ms (and the call's wall ms) a decode token, the medians of 3 pairs."""

    def call(n: int) -> dict[str, float]:
        parts.clear()
        sync()
        timing[0] = True
        t0 = time.perf_counter()
        model.generate(ids[:, :512], max_new_tokens=n, min_new_tokens=n, do_sample=False, disable_compile=True)
        sync()
        wall = time.perf_counter() - t0
        timing[0] = False
        return {"wall": wall, **parts}

    for n in (new, 1):  # warm: the plans and graphs of both shapes
        call(n)
    pairs = [(call(new), call(1)) for _ in range(3)]
    return {
        name: statistics.median((many.get(name, 0) - one.get(name, 0)) * 1e3 / (new - 1) for many, one in pairs)
        for name in pairs[0][0]
    }


def cprofiled(fn, n: int, sync) -> str:
    """cProfile of ``n`` calls of ``fn``: the functions by own time, then by cumulative time."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(n):
        fn()
    profile.disable()
    sync()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--who", default="mxgemm", choices=["bf16", "mxgemm"])
    parser.add_argument(
        "--generate",
        type=int,
        default=0,
        help="also eager generate of this many tokens (512-token prompt): host by part",
    )
    parser.add_argument("--cprofile", type=int, default=0, help="cProfile this many calls of layer 0's experts")
    parser.add_argument("--tiny", action="store_true", help="a few-MB model on the CPU: a smoke test of this script")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    e2e = e2e_module()
    model, _ = e2e.build(e2e.config(args.layers, args.tiny, True), args.who, (), device=device)
    ids = torch.randint(1, 500, (1, args.tokens), device=device, generator=torch.Generator(device).manual_seed(0))

    def prefill() -> tuple[float, float]:
        """(wall, host) seconds of one prefill: host is until the call returns, before synchronising."""
        sync()
        t0 = time.perf_counter()
        model(ids, use_cache=False)
        t1 = time.perf_counter()
        sync()
        return time.perf_counter() - t0, t1 - t0

    timed: dict[str, float] = defaultdict(float)  # host seconds by part while timing[0], what the hooks add to
    started: dict[int, float] = {}
    timing = [False]

    def before(module, _args):
        started[id(module)] = time.perf_counter()

    def after(module, _args, _out):
        if timing[0]:
            timed[names[id(module)]] += time.perf_counter() - started[id(module)]

    names: dict[int, str] = {}  # each watched module's part

    def watch(module, name: str | None = None) -> None:
        names[id(module)] = name or type(module).__name__
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    watch(model, "the model's forward")
    watch(model.lm_head, "lm_head")
    first_experts = model.model.layers[0].mlp.experts
    captured = []  # (args) of layer 0's experts' call: the routing of a real prefill
    first_experts.register_forward_pre_hook(lambda _m, a: captured.append(a) if not captured else None)
    for layer in model.model.layers:
        for module in (layer, layer.self_attn, layer.mlp, layer.mlp.gate, layer.mlp.experts):
            watch(module)
        watch(layer.input_layernorm, "input norm")

    with torch.inference_mode():
        for _ in range(2):
            prefill()
        timing[0] = True
        times = [prefill() for _ in range(args.repeats)]
        timing[0] = False
        parts = dict(timed)  # host seconds by part, over the timed prefills
        walls, hosts = [t[0] for t in times], [t[1] for t in times]
        with torch.profiler.profile(activities=[getattr(torch.profiler.ProfilerActivity, device.upper())]) as prof:
            for _ in range(args.repeats):
                prefill()
        decode = decode_parts(model, ids, args.generate, timed, timing, sync) if args.generate else {}
        experts_host = statistics.median(host_us(lambda: first_experts(*captured[0]), sync) for _ in range(5))
        profiled = cprofiled(lambda: first_experts(*captured[0]), args.cprofile, sync) if args.cprofile else ""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.device_time / args.repeats
            kernels[event.name][1] += 1 / args.repeats
    busy = sum(us for us, _ in kernels.values())
    wall = statistics.median(walls) * 1e3
    host = statistics.median(hosts) * 1e3
    print(
        f"{tree_commit()}, {args.who}: wall {wall:.1f} ms, host {host:.1f} ms (medians of {args.repeats}; walls "
        f"{', '.join(f'{w * 1e3:.1f}' for w in walls)}), GPU busy {busy / 1e3:.1f} ms"
    )
    print(
        "host ms a prefill by part (summed over the layers; a part includes the parts it calls): "
        + ", ".join(f"{name} {seconds * 1e3 / args.repeats:.1f}" for name, seconds in parts.items())
    )
    print(f"layer 0's experts called alone, back to back: host {experts_host:.0f} us a call")
    print("| us per prefill | calls | kernel |\n|---:|---:|---|")
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    for name, (us, calls) in ranked[: args.top]:
        print(f"| {us:.0f} | {calls:.0f} | {name[:150]} |")
    if decode:
        print(
            f"eager generate, a decode token (the {args.generate}-token call less the 1-token one): "
            + ", ".join(f"{name} {ms:.2f} ms" for name, ms in decode.items())
        )
    print(profiled)
    if args.json:
        doc = {
            "wall_ms": wall,
            "host_ms": host,
            "walls_ms": [w * 1e3 for w in walls],
            "busy_us": busy,
            "experts_host_us": experts_host,
            "decode_token_ms": decode,
            "host_parts_ms": {n: v * 1e3 / args.repeats for n, v in parts.items()},
            "kernels": {n: {"us": us, "calls": c} for n, (us, c) in ranked},
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
