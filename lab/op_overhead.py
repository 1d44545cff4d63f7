"""Host time of the routes into an op, on whatever machine runs it (no GPU needed): a trivial op defined as a
``torch.library.custom_op`` against the same op defined with ``torch.library.Library`` (one implementation for every
device key), and an ``MXFP8Linear`` call eager against the same call through ``mxgemm::linear`` (emulation backend on
CPU, the resolved backend on a GPU; M = 1, a 128 x 128 weight, so that the GEMM itself costs little).

Run: PYTHONPATH=src python3 lab/op_overhead.py --json op-overhead.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import mxgemm
from mxgemm.bench import environment
from mxgemm.device import describe_device
from mxgemm.ops import linear_op


def per_call_us(fn, calls: int = 3000, repeats: int = 7, warmup: int = 200) -> float:
    """Best of ``repeats`` rounds of ``calls`` back-to-back calls, after ``warmup`` calls (synchronized at the end on
    a GPU)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1, 128, dtype=torch.bfloat16, device=device)
    tensors = [torch.zeros(4, device=device)]

    @torch.library.custom_op("mxgemm_explore::clone_custom", mutates_args=())
    def clone_custom(x: torch.Tensor, ts: list[torch.Tensor], meta: str) -> torch.Tensor:
        return x.clone()

    lib = torch.library.Library("mxgemm_explore", "FRAGMENT")
    lib.define("clone_lib(Tensor x, Tensor[] ts, str meta) -> Tensor")
    lib.impl("clone_lib", lambda x, ts, meta: x.clone(), "CompositeExplicitAutograd")
    clone_lib = torch.ops.mxgemm_explore.clone_lib.default

    torch.manual_seed(0)
    layer = mxgemm.MXFP8Linear.from_linear(
        torch.nn.Linear(128, 128, bias=False, device=device, dtype=torch.bfloat16),
        backend="emulation" if device == "cpu" else None,
    )
    w = layer.prepared
    rows = {}
    with torch.no_grad():  # as Hugging Face generate runs (not inference mode: autograd's dispatch keys stay on)
        rows["clone"] = per_call_us(lambda: x.clone())
        rows["custom_op clone"] = per_call_us(lambda: clone_custom(x, tensors, "m"))
        rows["Library op clone"] = per_call_us(lambda: clone_lib(x, tensors, "m"))
        rows["MXFP8Linear eager"] = per_call_us(lambda: layer(x))
        rows["mxgemm::linear"] = per_call_us(lambda: linear_op(x, w.op_tensors, None, w.backend, w.op_meta))
    result = {"device": environment(describe_device(x.device)), "backend": layer.backend, "us_per_call": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{result['device']}, backend {layer.backend}")
    print("| route | µs per call |\n|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
