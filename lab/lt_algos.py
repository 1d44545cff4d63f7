"""Whether the planned cuBLASLt call (``kernels/cublaslt.linear_plan``) runs cuBLASLt's fastest blockwise algorithm:
on the Llama-3-8B projections at M = 512-4096, each algorithm the heuristic offers for the plan's problem
(``csrc/lt_algos.cu``; the plan runs the first), the quantizer included, timed under graph replay beside the same
quantizer and ``torch._scaled_mm`` (the ``cublas_block`` route), with the kernel each runs and whether its output
has the same bits.
In the llama3-8b benchmark set the planned call ran 1.4-12.5% slower than ``cublas_block`` at M = 1024-8192.

    PYTHONPATH=src python3 lab/lt_algos.py --json lt-algos.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import torch

import mxgemm
from mxgemm.block128 import padded_1x128_shape
from mxgemm.kernels import address, cublaslt, fp8_gemm, nvcc
from mxgemm.layouts import round_up
from mxgemm.timing import time_cuda

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
_P, _I, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong


def prepared_weight(n: int, k: int, generator: torch.Generator):
    """A random [n, k] weight (normal, std 0.02) quantized to MXFP8 and prepared for hybrid_sm90."""
    t = mxgemm.quantize(torch.randn(n, k, device="cuda", generator=generator).mul_(0.02).bfloat16())
    return mxgemm.MXFP8Linear.from_quantized(t.qdata, t.scale, backend="hybrid_sm90").prepared


def cases(ms: list[int], shapes=tuple(SHAPES)):
    """(name, n, k, m, weight, x) for each shape and M: the shape's prepared weight (prepared_weight) and, for each M,
    random bf16 activations [m, k], all drawn from one generator seeded 0 (also used by large_m_fp8.py and
    tokm_lab.py)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in shapes:
        n, k = SHAPES[name]
        w = prepared_weight(n, k, g)
        for m in ms:
            yield name, n, k, m, w, torch.randn(m, k, device="cuda", generator=g).bfloat16()


def library() -> ctypes.CDLL:
    source = Path(__file__).parent / "csrc" / "lt_algos.cu"
    product = Path(cublaslt.__file__).parent / "csrc"
    lib = nvcc.build(source, (9, 0), symbols=("lt_algos", "lt_use"), include_dirs=(cublaslt.header_dir(), product))
    lib.mxgemm_blockwise_plan_create.argtypes = [_P, _P, _P, *[_I] * 6, _LL, _LL, _LL, ctypes.POINTER(_P)]
    lib.mxgemm_blockwise_run.argtypes = [_P, _P, _I, _P, _P]
    lib.mxgemm_blockwise_plan_destroy.argtypes = [_P]
    lib.lt_algos.argtypes, lib.lt_use.argtypes = [_P, _LL, _I, _P, ctypes.POINTER(_I)], [_P, _P, _I]
    lib.lt_use.restype = _LL
    return lib


def kernels_of(fn) -> str:
    """The GPU kernels one call of ``fn`` runs, but for the quantizer."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    return ", ".join(sorted(n[:70] for n in names if "quant" not in n))


def algorithms(lib, quantizer: int, qd, bs, n: int, k: int, x, want: int) -> list[dict]:
    """Each algorithm the heuristic offers for M = x.shape[0] rows on the plan's problem: its time, kernel, bits
    against ``torch._scaled_mm`` on the same quantized operands."""
    m, (np_, kp) = x.shape[0], qd.shape
    xq, xs = fp8_gemm.quantize_1x128(x)
    ref = torch._scaled_mm(xq, qd.t(), xs, bs.t(), out_dtype=torch.bfloat16)[:m, :n]
    mp, _ = padded_1x128_shape(m, k)
    handle = _P()
    err = lib.mxgemm_blockwise_plan_create(quantizer, qd.data_ptr(), bs.data_ptr(), k, m, mp, np_, kp, 0,
                                           round_up(mp * np_ * 2, 256), mp * kp, cublaslt._WORKSPACE_MAX,
                                           ctypes.byref(handle))  # fmt: skip
    assert err == 0, err
    results, found = ctypes.create_string_buffer(lib.lt_result_bytes() * want), _I()
    assert lib.lt_algos(handle, cublaslt._WORKSPACE_MAX, want, results, ctypes.byref(found)) == 0
    buf = None

    def run() -> None:
        stream = _P(torch.cuda.current_stream().cuda_stream)
        assert lib.mxgemm_blockwise_run(handle, x.data_ptr(), k, buf.data_ptr(), stream) == 0

    out = []
    for i in range(found.value):
        buf = torch.empty(-(-lib.lt_use(handle, results, i) // 2), dtype=torch.bfloat16, device="cuda")
        try:
            run()
            torch.cuda.synchronize()
        except AssertionError:
            out.append({"index": i, "failed": True})
            continue
        y = buf[: mp * np_].view(mp, np_)[:m, :n]
        rel = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        out.append({"index": i, "us": time_cuda([run]), "kernel": kernels_of(run), "same_bits": torch.equal(y, ref),
                    "max_rel": rel})  # fmt: skip
    lib.mxgemm_blockwise_plan_destroy(handle)
    return out


def scaled_mm(qd, bs, x) -> dict:
    """The CUDA quantizer and ``torch._scaled_mm`` on ``x`` (the plan's work, through torch): time and kernel."""

    def run():
        xq, xs = fp8_gemm.quantize_1x128(x)
        return torch._scaled_mm(xq, qd.t(), xs, bs.t(), out_dtype=torch.bfloat16)

    return {"scaled_mm_us": time_cuda([run]), "scaled_mm_kernel": kernels_of(run)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--want", type=int, default=16, help="heuristic results asked for")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    lib = library()
    quantizer = address(fp8_gemm.library(torch.cuda.get_device_capability()).mxgemm_quant_1x128)
    rows = []
    for name, n, k, m, w, x in cases(args.m):
        qd, bs = w.tensors["qdata"], w.tensors["block_scale"]
        row = {"shape": name, "n": n, "k": k, "m": m, **scaled_mm(qd, bs, x),
               "algos": algorithms(lib, quantizer, qd, bs, n, k, x, args.want)}  # fmt: skip
        row["scaled_mm_again_us"] = scaled_mm(qd, bs, x)["scaled_mm_us"]  # the clocks' drift over the row
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| shape | M | _scaled_mm µs (again) | plan's algo µs | best algo µs (index) | algos | best's bits same |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ok = [a for a in r["algos"] if "us" in a]
        best = min(ok, key=lambda a: a["us"])
        print(f"| {r['shape']} | {r['m']} | {r['scaled_mm_us']:.1f} ({r['scaled_mm_again_us']:.1f}) | "
              f"{ok[0]['us']:.1f} | {best['us']:.1f} ({best['index']}) | {len(ok)} | "
              f"{best['same_bits']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
