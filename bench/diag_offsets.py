"""Diagnosis for bench/NOTES.md item 19's open question: does the FP8 kernel's time depend on where the quantized
activations lie in memory? The GEMM alone (no quantizer, no PDL) on the 70B and 7168-hidden gate_up at M = 1 and
16, with the activation codes copied to different offsets of one buffer (the scales and the output fixed). Two
values ~8% apart across offsets would say the address decides (e.g. the L2 slices of the lines every CTA reads).

Run on the device: cd bench && PYTHONPATH=../src python3 diag_offsets.py
"""

from functools import partial

import torch
from explore_small_m_pipeline import cold_weights

from mxgemm.kernels import fp8_gemm
from mxgemm.kernels.act_quant import quantize_1x128_padded
from mxgemm.timing import time_cuda

OFFSETS = [i * 1024 for i in range(16)] + [i * 65536 for i in range(1, 9)]


def main() -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in ((57344, 8192), (36864, 7168)):
        ws, bf16 = cold_weights(n, k, l2)
        del bf16
        np_, kp = ws[0].tensors["qdata"].shape
        for m in (1, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_1x128_padded(x)
            cfg = fp8_gemm.default_config(m, np_, kp, sms)
            out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
            buf = torch.empty(xq.numel() + max(OFFSETS), device="cuda", dtype=torch.uint8)
            times = []
            for off in OFFSETS:
                moved = buf[off : off + xq.numel()].view(torch.float8_e4m3fn).view(xq.shape)
                moved.copy_(xq)
                calls = [partial(fp8_gemm.fp8_gemm, moved, xs, m, w.tensors["qdata"], w.tensors["block_scale"], n,
                                 cfg, False, out) for w in ws]  # fmt: skip
                times.append(time_cuda(calls))
            cells = " ".join(f"{t:.1f}" for t in times)
            print(f"{n}x{k} M={m} {cfg}: µs per offset ({OFFSETS[0]}..{OFFSETS[-1]} bytes): {cells}", flush=True)
        del ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
