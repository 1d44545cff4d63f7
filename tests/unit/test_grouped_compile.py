"""The grouped kernels' Triton programs build for SM90 on a machine without a GPU (Triton's own compiler and
ptxas, target sm_90): every form the backends launch, so that a kernel change the interpreter runs cannot break its
GPU build unseen. A process of its own: under ``TRITON_INTERPRET=1`` Triton makes no GPU programs."""

import os
import subprocess
import sys

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mxgemm.kernels.grouped import fp8, quant, routing

TARGET = GPUTarget("cuda", 90, 32)
built = 0


def build(fn, types, constexprs, warps=4):
    global built
    signature = {a: "constexpr" if a in constexprs else types[a] for a in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    triton.compile(source, target=TARGET, options={"num_warps": warps, "num_stages": 3})
    built += 1


ints = lambda *names: {n: "i32" for n in names}  # noqa: E731
grouped = {"xs_ptr": "*fp32", "w_ptr": "*u8", "s_ptr": "*fp32", "off_ptr": "*i32", "src_ptr": "*i32"}
grouped |= ints("S", "N", "K", "E", "TOPK", "stride_xs", "stride_xsk", "stride_we", "stride_wn", "stride_se",
                "stride_sn", "stride_ys")
forms = [  # (quantized, gather, gated, scatter, bn, bm, the activations' and output's dtype)
    (False, False, False, False, 128, 16, "bf16"), (True, False, False, False, 128, 64, "bf16"),
    (True, False, False, False, 256, 64, "fp16"), (False, True, True, False, 64, 16, "bf16"),
    (True, True, True, False, 64, 64, "fp16"), (False, False, False, True, 128, 16, "bf16"),
    (True, False, False, True, 128, 64, "bf16"), (False, True, True, False, 16, 16, "bf16"),
    (False, False, False, True, 16, 16, "bf16"), (False, False, False, False, 32, 16, "bf16"),
]
for quantized, gather, gated, scatter, bn, bm, dtype in forms:
    types = {**grouped, "x_ptr": "*u8" if quantized else f"*{dtype}", "y_ptr": f"*{dtype}"}
    consts = {"GROUPS": 256, "BN": bn, "BM": bm, "QUANTIZED": quantized, "GATHER": gather, "GATED": gated,
              "SCATTER": scatter, "INTERPRET": False}
    build(fp8._grouped_kernel, types, consts, warps=8 if bn == 256 else 4)
for gather, gated, dtype in ((False, False, "bf16"), (True, False, "bf16"), (False, True, "bf16"),
                             (False, True, "fp16")):
    types = {"x_ptr": f"*{dtype}", "src_ptr": "*i32", "q_ptr": "*u8", "s_ptr": "*fp32"}
    types |= ints("S", "K", "Sp", "Kp", "TOPK", "stride_x")
    build(quant._rows_kernel, types, {"BLOCK": 16, "GATHER": gather, "GATED": gated, "INTERPRET": False})
for groups, chunk in ((8, 1024), (256, 32)):
    types = {"ids_ptr": "*i64", "counts_ptr": "*i32", "off_ptr": "*i32", "src_ptr": "*i32"}
    types |= ints("S", "E", "P", "PER")
    build(routing._count_kernel, types, {"CHUNK": chunk, "GROUPS": groups}, warps=8 if groups > 128 else 4)
    for one in (True, False):
        consts = {"CHUNK": chunk, "GROUPS": groups, "ONE": one}
        build(routing._place_kernel, types, consts, warps=8 if groups > 128 else 4)
types = {"y_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32"}
build(routing._combine_kernel, types, {"TOPK": 8, "BH": 1024, "INTERPRET": False})
print("built", built)
"""


def test_the_grouped_triton_kernels_build_for_sm90():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["built", "21"]
