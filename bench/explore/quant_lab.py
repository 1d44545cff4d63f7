"""The gated 1x128 quantizer's variant on bf16 pairs (``csrc/quant_lab.cu``) against the product's
(``fp8_gemm.quantize_1x128(g, up=u)``): the same bits (codes and scales) on the gate/up outputs of the Llama-3-8B MLP
(K = 14336) at several magnitudes, and each one's time under graph replay.

Run on the device: PYTHONPATH=src python3 bench/explore/quant_lab.py --json quant-lab.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
from functools import partial
from pathlib import Path

import torch

from mxgemm.block128 import padded_1x128_shape
from mxgemm.kernels import fp8_gemm, nvcc
from mxgemm.timing import time_cuda

_P, _I = ctypes.c_void_p, ctypes.c_int


def library() -> ctypes.CDLL:
    source = Path(__file__).parent / "csrc" / "quant_lab.cu"
    product = Path(fp8_gemm.__file__).parent / "csrc"
    lib = nvcc.build(source, (9, 0), suffix="a", symbols=("quant_lab_gated",), include_dirs=(product,))
    lib.quant_lab_gated.argtypes, lib.quant_lab_gated.restype = [_P, _I, _P, _I, _I, _I, _P, _P, _I, _I, _P], _I
    return lib


def pairs(lib, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The variant's codes [Mp, Kp] and scales (a [Mp, Kp/128] view), as the product's quantizer returns them."""
    m, k = g.shape
    mp, kp = padded_1x128_shape(m, k)
    q = torch.empty((mp, kp), dtype=torch.float8_e4m3fn, device=g.device)
    s = torch.empty((kp // 128, mp), dtype=torch.float32, device=g.device)
    err = lib.quant_lab_gated(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), m, k, q.data_ptr(), s.data_ptr(),
                              mp, kp, torch.cuda.current_stream().cuda_stream)  # fmt: skip
    if err:
        raise RuntimeError(f"quant_lab_gated failed to launch: cudaError {err}")
    return q, s.t()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[64, 2048, 4096])
    ap.add_argument("--k", type=int, default=14336)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    lib = library()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for m in args.m:
        for scale in (1.0, 1e-3, 1e3):
            g = (torch.randn(m, args.k, device="cuda", generator=gen) * scale).bfloat16()
            u = (torch.randn(m, args.k, device="cuda", generator=gen) * scale).bfloat16()
            q0, s0 = fp8_gemm.quantize_1x128(g, up=u)
            q1, s1 = pairs(lib, g, u)
            row = {"m": m, "k": args.k, "scale": scale,
                   "same_bits": torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1),
                   "product_us": time_cuda([partial(fp8_gemm.quantize_1x128, g, up=u)]),
                   "pairs_us": time_cuda([partial(pairs, lib, g, u)])}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    print("\n| M | K | scale | product µs | pairs µs | same bits |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['m']} | {r['k']} | {r['scale']:g} | {r['product_us']:.1f} | {r['pairs_us']:.1f} | "
              f"{r['same_bits']} |")  # fmt: skip


if __name__ == "__main__":
    main()
