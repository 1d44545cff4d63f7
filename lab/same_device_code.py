"""Whether an edit of the CUDA sources changed the device code: each library of the package's kernels compiled to a
cubin at a git revision and in the working tree (the device-code flags of ``mxgemm.kernels.nvcc``: -O3 and each
library's architecture and include folders, which LIBRARIES repeats from the bindings; no GPU needed), and the
bytes of every kernel's sections compared (its machine code ``.text``, the ``.nv.info`` that gives its registers and
parameters, its shared and constant memory). Kernels are matched by name; ``--rename OLD=NEW`` pairs names an edit
changed (a substring of the mangled name replaced). Exit status 0 when every kernel of the revision is in the tree
with the same bytes and the tree has no others.

Run here or on the device: python3 lab/same_device_code.py REV [--rename OLD=NEW ...]
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = Path("src/mxgemm/kernels")
# (source under the kernels' folder, architecture, include folders under it): the libraries nvcc.build makes with
# their own kernels (blockwise.cu is cuBLASLt's host code)
LIBRARIES = [
    ("csrc/fp8_gemm.cu", "90a", ()),
    ("csrc/small_m.cu", "90", ()),
    ("grouped/csrc/grouped_fp8.cu", "90a", ("csrc",)),
]


def sections(cubin: bytes) -> tuple[dict[str, bytes], list[str]]:
    """The named sections of an ELF64 little-endian file with their bytes (a size for those without file bytes), and
    the names of its symbols by index."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def data(h) -> bytes:
        return cubin[h[4] : h[4] + h[5]]

    def name(table: bytes, at: int) -> str:
        return table[at : table.index(b"\0", at)].decode()

    names = data(headers[shstrndx])
    out = {}
    for h in headers:
        out[name(names, h[0])] = f"{h[5]} bytes".encode() if h[1] == 8 else data(h)  # SHT_NOBITS: a size
    symtab = next(h for h in headers if h[1] == 2)  # SHT_SYMTAB, its strings in the section it links
    strings = data(headers[symtab[6]])
    symbols = [name(strings, struct.unpack_from("<I", data(symtab), i)[0]) for i in range(0, symtab[5], 24)]
    return out, symbols


def info_records(info: bytes, symbols: list[str]) -> bytes:
    """A kernel's ``.nv.info`` section with the symbol index that its constant bank record (EIATTR_PARAM_CBANK) holds
    written as that symbol's name: the index moves when other kernels come or go, the kernel does not."""
    out, i = [], 0
    while i < len(info):
        fmt, attr = info[i], info[i + 1]
        size = struct.unpack_from("<H", info, i + 2)[0] if fmt == 4 else 2 if fmt == 3 else 0
        start = i + (4 if fmt == 4 else 2)
        payload = info[start : start + size]
        if attr == 0x0A and size >= 4:
            symbol = _ANONYMOUS.sub("(anonymous)", symbols[struct.unpack_from("<I", payload)[0]])
            payload = symbol.encode() + payload[4:]
        out.append(bytes([fmt, attr]) + payload)
        i = start + size
    return b"|".join(out)


# the anonymous namespace's mangled name, which carries a hash of the file's path
_ANONYMOUS = re.compile(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}")


def kernels(cubin: bytes) -> dict[str, dict[str, bytes]]:
    """Each kernel's sections by the kernel's mangled name (its anonymous namespace's hash left out):
    ``.text.<name>`` and every other section named after it (``.nv.info.<name>`` as :func:`info_records` reads it)."""
    secs, symbols = sections(cubin)
    names = [s[len(".text.") :] for s in secs if s.startswith(".text.")]
    out = {}
    for n in names:
        own = {s[: -len(n)]: b for s, b in secs.items() if s.endswith("." + n)}
        if ".nv.info." in own:
            own[".nv.info."] = info_records(own[".nv.info."], symbols)
        out[_ANONYMOUS.sub("(anonymous)", n)] = own
    return out


def compile_all(kernels_dir: Path, out: Path) -> dict[str, dict[str, dict[str, bytes]]]:
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    for source, arch, includes in LIBRARIES:
        path = kernels_dir / source
        if not path.exists():
            continue
        cubin = out / (path.stem + ".cubin")
        cmd = ["nvcc", "-cubin", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", str(cubin), str(path)]
        cmd[1:1] = [f"-I{kernels_dir / i}" for i in includes]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"nvcc failed on {path}:\n{done.stderr[-2000:]}")
        found[source] = kernels(cubin.read_bytes())
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("rev", help="the git revision to compare the working tree against")
    parser.add_argument("--rename", nargs="*", default=[], help="OLD=NEW: a substring of kernel names the edit changed")
    args = parser.parse_args()
    renames = [r.split("=", 1) for r in args.rename]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.rev, str(KERNELS)], capture_output=True, check=True
        ).stdout
        (tmp / "rev").mkdir()
        subprocess.run(["tar", "-x", "-C", str(tmp / "rev")], input=archive, check=True)
        before = compile_all(tmp / "rev" / KERNELS, tmp / "out-rev")
        after = compile_all(ROOT / KERNELS, tmp / "out-tree")
    old_kernels = {n: k for lib in before.values() for n, k in lib.items()}
    new_kernels = {n: k for lib in after.values() for n, k in lib.items()}
    same = changed = 0
    problems = []
    for name, secs in sorted(old_kernels.items()):
        new_name = name
        for old, new in renames:  # in the name, and in the names its sections hold
            new_name = new_name.replace(old, new)
            secs = {s: b.replace(old.encode(), new.encode()) for s, b in secs.items()}
        if new_name not in new_kernels:
            problems.append(f"only at {args.rev}: {name}")
            continue
        new_secs = new_kernels.pop(new_name)
        diff = [s for s in sorted(set(secs) | set(new_secs)) if secs.get(s) != new_secs.get(s)]
        if diff:
            changed += 1
            problems.append(f"changed: {name} ({', '.join(diff)})")
        else:
            same += 1
    problems += [f"only in the tree: {name}" for name in sorted(new_kernels)]
    print("\n".join(problems[:40] + [f"... and {len(problems) - 40} more"] * (len(problems) > 40)))
    print(f"{same} kernels with the same bytes, {changed} changed, {len(problems) - changed} without a match")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
