"""Building mxgemm's hand-written CUDA kernels: nvcc on first use, the shared library cached on disk, ctypes to load.

A library is compiled once per source, nvcc version and GPU architecture into ``$MXGEMM_CACHE_DIR/kernels`` (seconds)
under a file lock; nothing is built or loaded at import time.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..cache import cache_root, locked

logger = logging.getLogger("mxgemm")

__all__ = ["build", "find_nvcc"]


def find_nvcc() -> str | None:
    """nvcc from ``$CUDA_HOME``/``$CUDA_PATH``, ``PATH``, or ``/usr/local/cuda``; None if there is none."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and (Path(root) / "bin" / "nvcc").exists():
            return str(Path(root) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def build(source: Path, capability: tuple[int, int], suffix: str = "") -> ctypes.CDLL:
    """Build (once, cached on disk) and load ``source`` for a GPU architecture; ``suffix`` "a" targets the
    architecture-specific features (sm_90a: wgmma). Raises RuntimeError with nvcc's message when it cannot be built."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc was not found (set CUDA_HOME or put the CUDA toolkit's bin folder on PATH)")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    arch = f"{capability[0]}{capability[1]}{suffix}"
    digest = hashlib.sha256(source.read_bytes() + version.encode() + arch.encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-sm{arch}-{digest}.so"
    with locked(target):
        if not target.exists():
            logger.info("mxgemm: building %s for sm_%s into %s (once)", source.name, arch, target.parent)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / target.name
                cmd = [nvcc, "-shared", "-Xcompiler", "-fPIC", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                       "-o", str(out), str(source)]  # fmt: skip
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"nvcc failed to build {source.name}: {done.stderr.strip()[-500:]}")
                os.replace(out, target)
    return ctypes.CDLL(str(target))
