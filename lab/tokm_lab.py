"""Variants of the tokens-as-M FP8 kernel at prefill sizes (``csrc/tokm_lab.cu``) against the product's kernel and
cuBLASLt's blockwise GEMM (``torch._scaled_mm``, the kernel hybrid_sm90's planned call runs), the GEMM alone on the
same quantized activations, on the Llama-3-8B projections: time under graph replay, TFLOP/s, and whether each output
has cuBLASLt's bits. Variants: a producer warp (288 threads) or warpgroup that gives its registers to the consumers
(384, setmaxnreg), the two consumer warpgroups issuing their wgmma as they come, in turn, or each once the other's
block has finished (ping-pong), each block's wgmma as two independent chains (a half of the weight rows each), three
consumer warpgroups (192 tokens a CTA), and CTAs in pairs (clusters of two token tiles) that multicast the shared weight
tile's halves.

Run on the device: PYTHONPATH=src python3 lab/tokm_lab.py --json tokm-lab.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
from functools import partial
from pathlib import Path

import torch
from lt_algos import cases  # beside this script

from mxgemm.kernels import fp8_gemm, nvcc
from mxgemm.kernels.fp8_gemm import TokensAsM
from mxgemm.timing import time_cuda

VARIANTS = {
    0: "warp",
    1: "warpgroup",
    2: "warp, in turn",
    3: "warpgroup, in turn",
    4: "warp, pairs",
    5: "warpgroup, pairs",
    6: "warp, ping-pong",
    7: "warpgroup, ping-pong",
    8: "warp, two chains",
    9: "warpgroup, two chains",
    10: "warp, three warpgroups",
    11: "warpgroup, three warpgroups",
}
_P, _I = ctypes.c_void_p, ctypes.c_int


def library() -> ctypes.CDLL:
    source = Path(__file__).parent / "csrc" / "tokm_lab.cu"
    product = Path(fp8_gemm.__file__).parent / "csrc"
    lib = nvcc.build(source, (9, 0), suffix="a", symbols=("tokm_lab",), include_dirs=(product,))
    lib.tokm_lab.argtypes, lib.tokm_lab.restype = [_P, _P, _I, _P, _P, _P, *[_I] * 8, _P], _I
    return lib


def valid(variant: int, wn: int, stages: int) -> bool:
    """Pairs multicast 64-row halves of 128-row tiles; three warpgroups' rings of 128-row tiles hold 4 stages."""
    return (variant not in (4, 5) or wn == 128) and (variant not in (10, 11) or wn == 64 or stages == 4)


def run_lab(lib, qd, bs, xq, xs, y, n: int, wn: int, stages: int, variant: int) -> torch.Tensor:
    """One variant's GEMM of the quantized activations (xq [Mp, Kp], xs) into y [M, n]."""
    (np_, kp), mp = qd.shape, xq.shape[0]
    stream = torch.cuda.current_stream().cuda_stream
    err = lib.tokm_lab(qd.data_ptr(), bs.data_ptr(), bs.stride(0), xq.data_ptr(), xs.data_ptr(), y.data_ptr(),
                       y.shape[0], mp, n, np_, kp, wn, stages, variant, stream)  # fmt: skip
    if err:
        raise RuntimeError(f"tokm_lab failed to launch: cudaError {err}")
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[2048])
    ap.add_argument("--variants", type=int, nargs="+", default=list(VARIANTS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    lib = library()
    rows = []
    for name, n, k, m, w, x in cases(args.m):
        qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
        xq, xs = fp8_gemm.quantize_1x128(x, rows_multiple=128)
        cublas = partial(torch._scaled_mm, xq, qd.t(), xs, bs.t(), out_dtype=torch.bfloat16)
        ref = cublas()[:m, :n]
        row = {"shape": name, "n": n, "k": k, "m": m, "cublas_us": time_cuda([cublas]), "product": {}, "lab": {}}
        for wn in (128, 64):
            for st in (4, 6):
                cfg = TokensAsM(128, wn, 1, st)
                run = partial(fp8_gemm.fp8_gemm, xq, xs, m, qd, bs, n, cfg, pdl=False)
                row["product"][f"wn{wn}-st{st}"] = {"us": time_cuda([run]), "same_bits": torch.equal(run(), ref)}
                for v in (v for v in args.variants if valid(v, wn, st)):
                    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                    lab = partial(run_lab, lib, qd, bs, xq, xs, y, n, wn, st, v)
                    same = torch.equal(lab(), ref)
                    row["lab"][f"wn{wn}-st{st}-v{v}"] = {"us": time_cuda([lab]), "same_bits": same}
        row["cublas_again_us"] = time_cuda([cublas])
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    names = [VARIANTS[v] for v in args.variants]
    print("\n| shape | M | cuBLASLt µs (again) | product best µs | " + " | ".join(names) + " | bits |")
    print("|---|---|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        fastest = partial(min, key=lambda pair: pair[1])
        best = {v: fastest((c, d["us"]) for c, d in r["lab"].items() if c.endswith(f"-v{v}")) for v in args.variants}
        prod = fastest((c, d["us"]) for c, d in r["product"].items())
        ok = all(d["same_bits"] for d in [*r["lab"].values(), *r["product"].values()])
        cells = " | ".join(f"{us:.1f} ({c.rsplit('-', 1)[0]})" for c, us in best.values())
        print(f"| {r['shape']} | {r['m']} | {r['cublas_us']:.1f} ({r['cublas_again_us']:.1f}) | {prod[1]:.1f} "
              f"({prod[0]}) | {cells} | {ok} |")  # fmt: skip


if __name__ == "__main__":
    main()
