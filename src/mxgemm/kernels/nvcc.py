"""Building mxgemm's hand-written CUDA kernels: nvcc on first use, the shared library cached on disk, ctypes to load.

A library is compiled once per source, compiler (path and version), flags and GPU architecture into
``$MXGEMM_CACHE_DIR/kernels`` (seconds) under a file lock; nothing is built or loaded at import time. A built
library is used only if it matches the SHA-256 recorded beside it when it was built and exports the symbols asked
for; anything else (a truncated or foreign file) is rebuilt. A cache folder that cannot be written still serves the
builds it holds; new ones then go to this user's private folder under the system's temporary directory
(:func:`mxgemm.cache.cache_folders`). A folder other users could change is never read or written. nvcc gets
``BUILD_TIMEOUT_S`` seconds.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..cache import build_in_cache, check_trusted_dir, locked

logger = logging.getLogger("mxgemm")

__all__ = ["BUILD_TIMEOUT_S", "build", "find_nvcc"]

BUILD_TIMEOUT_S = 600


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


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} did not finish in {BUILD_TIMEOUT_S} s: {' '.join(cmd[:2])} ...") from None
    except OSError as exc:
        raise RuntimeError(f"{what} could not run: {exc}") from None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_verified(target: Path, symbols: Sequence[str]) -> ctypes.CDLL | None:
    """The library at ``target`` if it is the one built there (its recorded SHA-256) and exports ``symbols``."""
    sidecar = target.with_name(target.name + ".sha256")
    try:
        if not target.is_file() or sidecar.read_text().strip() != _sha256(target):
            return None
        lib = ctypes.CDLL(str(target))
    except OSError:
        return None
    missing = [s for s in symbols if not hasattr(lib, s)]
    if missing:
        logger.warning("mxgemm: %s lacks %s: rebuilding it", target, ", ".join(missing))
        return None
    return lib


def _compile(nvcc: str, flags: list[str], source: Path, target: Path) -> None:
    logger.info("mxgemm: building %s into %s (once)", source.name, target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = _run([nvcc, *flags, "-o", str(out), str(source)], "nvcc")
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"nvcc failed to build {source.name}: {done.stderr.strip()[-500:]}")
        digest = Path(tmp) / "sha256"
        digest.write_text(_sha256(out))
        os.replace(out, target)
        os.replace(digest, target.with_name(target.name + ".sha256"))


def build(
    source: Path,
    capability: tuple[int, int],
    suffix: str = "",
    symbols: Sequence[str] = (),
    include_dirs: Sequence[Path] = (),
) -> ctypes.CDLL:
    """Build (once, cached on disk) and load ``source`` for a GPU architecture; ``suffix`` "a" targets the
    architecture-specific features (sm_90a: wgmma). ``symbols``: what the library must export; ``include_dirs``:
    header folders beyond the toolkit's. Raises RuntimeError saying why when it cannot be built or loaded."""
    nvcc, flags, name = _build_key(source, capability, suffix, include_dirs)

    def build_in(folder: Path) -> ctypes.CDLL:
        target = folder / name
        if os.path.lexists(folder):  # checked before anything in it is loaded; a folder that cannot be written still
            check_trusted_dir(folder)  # serves the builds it holds
            lib = _load_verified(target, symbols)
            if lib is not None:
                return lib
        with locked(target):  # makes the folder private where it is new
            if _load_verified(target, symbols) is None:  # not built by another process meanwhile
                _compile(nvcc, flags, source, target)
        lib = _load_verified(target, symbols)
        if lib is None:
            raise RuntimeError(f"{target} was built but does not load or lacks {', '.join(symbols) or 'its symbols'}")
        return lib

    return build_in_cache("kernels", source.name, build_in)


def _build_key(
    source: Path, capability: tuple[int, int], suffix: str, include_dirs: Sequence[Path] = ()
) -> tuple[str, list[str], str]:
    """(nvcc, its flags, the library's file name): the name covers the source and the headers beside it and in
    ``include_dirs``, the compiler's path and version, the flags and the architecture."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc was not found (set CUDA_HOME or put the CUDA toolkit's bin folder on PATH)")
    version = _run([nvcc, "--version"], "nvcc --version").stdout
    arch = f"{capability[0]}{capability[1]}{suffix}"
    flags = [
        "-shared",
        "-Xcompiler",
        "-fPIC",
        "-O3",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        *(f"-I{d}" for d in include_dirs),
    ]
    compiler = str(Path(nvcc).resolve())
    folders = [source.parent, *include_dirs]
    headers = [h.read_bytes() for folder in folders for h in sorted(Path(folder).glob("*.cuh"))]  # what it includes
    key = b"\0".join([source.read_bytes(), *headers, version.encode(), compiler.encode(), " ".join(flags).encode()])
    return nvcc, flags, f"{source.stem}-sm{arch}-{hashlib.sha256(key).hexdigest()[:16]}.so"
