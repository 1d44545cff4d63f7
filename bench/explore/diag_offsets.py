"""Diagnosis for docs/performance.md (item 19's open question): does the FP8 kernel's time depend on where the
quantized activations lie in memory? The GEMM alone (no quantizer, no PDL) on the 70B gate_up / down and 7168-hidden
gate_up at M = 1 and 16, with the activation codes copied to different offsets of one buffer (the scales and the
output fixed); offset 0 four times first (the same addresses: does the time still change from one call of
`time_cuda` to the next?). Two values ~8% apart across offsets would say the address decides (e.g. the L2 slices of
the lines every CTA reads). Each row runs twice: the kernel as built, and a variant whose activation tensor map ends
at row M instead of Mp (TMA zero-fills the padding rows instead of reading them; its output checked bitwise against
the built one's). Last, the whole path (`mxgemm.linear`, quantizer included) captured anew six times, as the
benchmark does.

Run on the device: cd bench && PYTHONPATH=../src python3 diag_offsets.py
"""

from functools import partial

import torch
from explore_fp8_bounds import patched_library
from explore_small_m_pipeline import cold_weights

import mxgemm
from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.act_quant import quantize_1x128_padded
from mxgemm.timing import time_cuda

OFFSETS = [0, 0, 0, 0] + [i * 1024 for i in range(1, 16)] + [i * 65536 for i in range(1, 9)]
SHAPES = ((57344, 8192), (8192, 28672), (36864, 7168))


def main() -> None:
    props = torch.cuda.get_device_properties(0)
    cap = torch.cuda.get_device_capability()
    built = fp8_gemm.library(cap)
    rows_m = [("make_map(&xmap, X, a.Mp, a.Kp, TN)", "make_map(&xmap, X, a.M, a.Kp, TN)")]
    libs = {"Mp rows": built, "M rows": patched_library("rows-m", rows_m, cap)}
    summary = []
    for n, k in SHAPES:
        ws, _ = cold_weights(n, k, props.L2_cache_size, bf16=False)
        np_, kp = ws[0].tensors["qdata"].shape
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_1x128_padded(x)
            cfg = fp8_gemm.default_config(m, np_, kp, props.multi_processor_count)
            out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
            buf = torch.empty(xq.numel() + max(OFFSETS), device="cuda", dtype=torch.uint8)
            outs = {}
            for name, lib in libs.items():
                fp8_gemm.library = lambda _cap, lib=lib: lib
                times = []
                for off in OFFSETS:
                    moved = buf[off : off + xq.numel()].view(torch.float8_e4m3fn).view(xq.shape)
                    moved.copy_(xq)
                    calls = [partial(fp8_gemm.fp8_gemm, moved, xs, m, w.tensors["qdata"], w.tensors["block_scale"],
                                     n, cfg, False, out) for w in ws]  # fmt: skip
                    times.append(time_cuda(calls))
                outs[name] = fp8_gemm.fp8_gemm(xq, xs, m, ws[0].tensors["qdata"], ws[0].tensors["block_scale"], n,
                                               cfg, False).clone()  # fmt: skip
                cells = " ".join(f"{t:.1f}" for t in times)
                print(f"{n}x{k} M={m} {name} {cfg}: µs per offset: {cells}", flush=True)
                summary.append((f"{n}x{k}", m, name, min(times), sorted(times)[len(times) // 2], max(times)))
            same = torch.equal(outs["Mp rows"], outs["M rows"])
            print(f"{n}x{k} M={m}: outputs bitwise equal: {same}", flush=True)
            fp8_gemm.library = lambda _cap: built
            whole = [time_cuda([partial(mxgemm.linear, x, w) for w in ws]) for _ in range(6)]
            print(f"{n}x{k} M={m} mxgemm.linear, 6 captures: " + " ".join(f"{t:.1f}" for t in whole), flush=True)
            summary.append((f"{n}x{k}", m, "linear x6", min(whole), sorted(whole)[3], max(whole)))
        del ws
        torch.cuda.empty_cache()
    print(f"{'shape':>12} {'M':>3} {'variant':>10} {'min':>7} {'median':>7} {'max':>7}")
    for row in summary:
        print(f"{row[0]:>12} {row[1]:>3} {row[2]:>10} {row[3]:7.1f} {row[4]:7.1f} {row[5]:7.1f}")


if __name__ == "__main__":
    main()
