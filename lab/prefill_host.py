"""Host time of the eager 2048-token prefill of a Llama at 8B dimensions: bf16 against mxgemm's routes for the q/k/v
and gate/up groups above ``fusion.MAX_ROWS`` rows: each member's own GEMM on one quantization of the input, made by
the first member's planned cuBLASLt call (as shipped: "planned") or by the CUDA quantizer alone with
``torch._scaled_mm`` per member ("scaled_mm"); or each member's own planned call ("unshared"). Per route: the host time
to enqueue 8 decoder layers with the GPU held busy (nothing waits on it), the 8 layers' time back to back, and
``generate`` of one token on the 32-layer model (the benchmark's prefill); per call at M = 2048 on the q weight, the
host time of each piece; whether the routes give the same bits.

Run on the device: PYTHONPATH=src python3 lab/prefill_host.py --json prefill-host.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from decode_anatomy import wall  # beside this script
from large_m_calls import enqueue_us

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from model_e2e import build

from mxgemm.backends import get_backend, hybrid_sm90

ENQUEUE_LAYERS = 8  # their kernels stay within the launch queue's depth behind the sleep kernel


@contextlib.contextmanager
def route(backend, name: str):
    """mxgemm's route above MAX_ROWS: "planned" (as shipped), "scaled_mm" or "unshared"."""
    saved = hybrid_sm90._rows_plan
    if name == "scaled_mm":
        hybrid_sm90._rows_plan = lambda weight, m, x_dtype: False
    if name == "unshared":
        backend.run_sharing = lambda x, weight, bias: None
    try:
        yield
    finally:
        hybrid_sm90._rows_plan = saved
        vars(backend).pop("run_sharing", None)  # the instance's attribute shadows the method until deleted


def run_layers(model, hidden, pos):
    for layer in model.model.layers[:ENQUEUE_LAYERS]:
        out = layer(hidden, position_embeddings=pos)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def enqueue_ms(fn, rounds: int = 5) -> float:
    """Host time of ``fn`` with the GPU held busy by a sleep kernel ahead of it, best of ``rounds``."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # about 0.5 s of device time
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
        torch.cuda.synchronize()
    return best * 1e3


def timed_ms(fn, rounds: int = 5) -> float:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    models = {who: build(32, who, ())[0] for who in ("bf16", "mxgemm")}
    backend = get_backend(models["mxgemm"].model.layers[0].self_attn.q_proj.prepared.backend)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, 128256, (1, args.tokens), device="cuda", generator=g)
    hidden = torch.randn(1, args.tokens, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    variants = [("bf16", None), *(("mxgemm", r) for r in ("planned", "scaled_mm", "unshared"))]
    rows = {f"{who} {r or ''}".strip(): {"enqueue_ms": [], "layers_ms": [], "prefill_ms": []} for who, r in variants}
    kw = {"disable_compile": True}
    with torch.inference_mode():
        pos = models["bf16"].model.rotary_emb(hidden, torch.arange(args.tokens, device="cuda")[None])
        outs = {}
        for who, r in variants:  # warm-up: plans and cuBLASLt's heuristics made before timing
            with route(backend, r) if r else contextlib.nullcontext():
                outs[r] = run_layers(models[who], hidden, pos)
                wall(models[who], ids, 1, kw)
        same = {"planned vs scaled_mm": bool(torch.equal(outs["planned"], outs["scaled_mm"])),
                "planned vs unshared": bool(torch.equal(outs["planned"], outs["unshared"]))}  # fmt: skip
        print("same bits after 8 layers:", same, flush=True)
        for _ in range(args.rounds):  # the variants interleaved, round by round
            for who, r in variants:
                row = rows[f"{who} {r or ''}".strip()]
                with route(backend, r) if r else contextlib.nullcontext():
                    row["enqueue_ms"].append(enqueue_ms(lambda m=models[who]: run_layers(m, hidden, pos), rounds=1))
                    row["layers_ms"].append(timed_ms(lambda m=models[who]: run_layers(m, hidden, pos), rounds=1))
                    row["prefill_ms"].append(wall(models[who], ids, 1, kw) * 1e3)
        # one GEMM at M = 2048 on layer 0's q and k weights: the host time of each piece
        attn = models["mxgemm"].model.layers[0].self_attn
        q, k = attn.q_proj.shared[0].members[:2]
        x = hidden.view(args.tokens, 4096)
        _, shared_rows = backend.run_sharing(x, q, None)
        planned = k.plans.shared[(args.tokens, x.dtype)]
        quantized = hybrid_sm90.fp8_gemm.quantize_1x128(x)
        t = k.tensors
        bf16_q = models["bf16"].model.layers[0].self_attn.q_proj.weight
        calls = {
            "bf16 F.linear (q)": lambda: F.linear(x, bf16_q),
            "mxgemm run_sharing (q: quantizer + GEMM)": lambda: backend.run_sharing(x, q, None),
            "mxgemm run_quantized (k: GEMM alone)": lambda: backend.run_quantized(x, shared_rows, k, None),
            "mxgemm planned GEMM alone (k)": lambda: planned.on_quantized(shared_rows, x, None),
            "mxgemm CUDA quantizer": lambda: hybrid_sm90.fp8_gemm.quantize_1x128(x),
            "mxgemm _scaled_mm (k)": lambda: hybrid_sm90.blockwise_linear(
                x, t["qdata"], t["block_scale"], k.out_features, None, quantize=lambda _: quantized),
        }  # fmt: skip
        per_call = {name: enqueue_us(fn) for name, fn in calls.items()}
    summary = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in rows.items()}
    doc = {"device": torch.cuda.get_device_name(), "tokens": args.tokens, "enqueue_layers": ENQUEUE_LAYERS,
           "same_bits": same, "rounds": rows, "medians": summary, "per_call_enqueue_us_m2048_q": per_call}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(json.dumps(per_call, indent=1))
    n = ENQUEUE_LAYERS
    print(f"| route | enqueue {n} layers ms (host) | {n} layers ms | prefill {args.tokens} ms |")
    print("|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['enqueue_ms']:.2f} | {s['layers_ms']:.2f} | {s['prefill_ms']:.1f} |")


if __name__ == "__main__":
    main()
