"""Where the GEMV's weight loads sit in its SASS, built for sm_90a on any machine (no GPU): Triton's compiler and the
ptxas it ships, then ``cuobjdump -sass``.

For each config: registers, the positions (instruction index) of its 16-byte global loads and of its first FP8
conversion. Loads written where they are converted come out one after another's conversion (one in flight a thread);
a step's loads written first come out together:
PYTHONPATH=src python3 lab/gemv_sass.py
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mxgemm.kernels.grouped import gemv

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp32", "off_ptr": "*i32", "y_ptr": "*bf16", "src_ptr": "*i32"}
ALIGNED = ("x_ptr", "w_ptr", "s_ptr", "off_ptr", "y_ptr", "src_ptr", "N", "K", "stride_xs", "stride_we", "stride_wn")
CONFIGS = [(16, 4, 4, False), (32, 4, 4, False), (16, 16, 4, False), (32, 8, 8, False), (64, 2, 8, True)]


def sass(bn: int, kb: int, warps: int, gated: bool) -> tuple[str, list[str]]:
    """Registers and SASS instructions of the plain (or gathered gated) kernel for ``bn`` x ``kb``."""
    consts = {"GROUPS": 256, "BN": bn, "KB": kb, "STAGES": 1, "GATHER": gated, "GATED": gated, "SCATTER": False}
    consts["INTERPRET"] = False
    names = gemv._gemv_kernel.arg_names
    signature = {a: POINTERS.get(a, "constexpr" if a in consts else "i32") for a in names}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED}  # as the launcher sees 16-aligned args
    src = ASTSource(gemv._gemv_kernel, signature, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        text = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs = next(w for w in usage.split() if w.startswith("REG:"))
    lines = [m.group(1) for m in re.finditer(r"^\s*/\*[0-9a-f]{4,}\*/\s*([^;]*);", text, re.MULTILINE)]
    return regs, lines


def main() -> None:
    for bn, kb, warps, gated in CONFIGS:
        regs, ins = sass(bn, kb, warps, gated)
        loads = [i for i, line in enumerate(ins) if "LDG.E.128" in line]
        convert = next(i for i, line in enumerate(ins) if "E4M3.UNPACK_B" in line)
        form = "gated" if gated else "plain"
        where = f"16-byte loads at {loads}, first FP8 conversion {convert}"
        print(f"bn {bn:3d} kb {kb:2d} warps {warps} {form}: {regs}, {where}")


if __name__ == "__main__":
    main()
