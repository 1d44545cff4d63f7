"""Eager calls from the layer to the kernel launch with no Python in between.

A launch plan of the CUDA kernels (:class:`mxgemm.kernels.Launch`) can be called from C++: its ``entry``
(:class:`mxgemm.kernels.LaunchEntry`) names its C entry point, the plan's address and the buffer a call writes. When the
Python path (:func:`ops.run_planned`, ``Backend.run_gated``) makes such a plan for bf16 activations, the prepared
weight's table (``PreparedWeight.fast``, made then) takes it under its M; :func:`mxgemm.linear`,
:meth:`MXFP8Linear.on_gated` and so every eager call of a layer call the table first. One C++ function
(``csrc/fast_call.cpp``, a pybind11 extension built with ``torch.utils.cpp_extension`` on first use and cached on disk)
checks the activations as the plan's Python launcher takes them, allocates the output and calls the entry on the current
stream: the same plan, the same bits, without the Python layers, launcher and ctypes call between (what each costs:
docs/performance.md, "Eager calls and whole models"). Where it answers None (an M without a plan yet, fp16 or fp32
activations, rows the kernels read only from a copy, a bias they do not add, gradients, tensor subclasses, a dispatch
mode, tuning changed since the plan was made), the Python path runs.

``MXGEMM_FAST_CALLS=0`` turns it off; :func:`status` says whether it runs here and why not.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
from pathlib import Path

import torch

from . import settings, tuning
from .availability import Availability
from .cache import build_in_cache, locked, private_dir
from .kernels import Launch

__all__ = ["extension", "register", "status"]

logger = logging.getLogger("mxgemm")

_SOURCE = Path(__file__).parent / "csrc" / "fast_call.cpp"


@functools.cache
def extension():
    """Build (once, cached on disk under ``$MXGEMM_CACHE_DIR/ext``, else this user's private folder under the system's
    temporary directory; :func:`mxgemm.cache.private_dir`) and import the extension. Raises RuntimeError saying why
    it cannot."""
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja, which torch.utils.cpp_extension builds with, is not installed (pip install ninja)")
    key = b"\0".join([_SOURCE.read_bytes(), torch.__version__.encode(), sys.version.encode()])
    name = f"mxgemm_fast_call_{hashlib.sha256(key).hexdigest()[:16]}"

    def build_in(root: Path):
        folder = root / name
        with locked(folder):  # makes the folders private where they are new, checks them where they are not
            return _build_and_load(cpp_extension, name, folder)

    module = build_in_cache("ext", _SOURCE.name, build_in)
    module.set_generation(tuning.generation())
    tuning.on_change(module.set_generation)  # entries made before tuning changed a cache are stale
    return module


def _build_and_load(cpp_extension, name: str, folder: Path):
    """Build (where needed) and import the extension in ``folder``, under the caller's lock. torch's own build lock
    left by a killed build is removed (no live build can hold it: they all hold ours), and a library that does not
    match the SHA-256 recorded after its last build (a truncated file would crash the import) is removed, so that ninja
    builds it again."""
    private_dir(folder)
    (folder / "lock").unlink(missing_ok=True)
    library, record = folder / f"{name}.so", folder / f"{name}.so.sha256"
    if library.exists() and (not record.is_file() or record.read_text().strip() != _sha256(library)):
        library.unlink()
    record.unlink(missing_ok=True)
    logger.info("mxgemm: building the fast-call extension in %s (once)", folder)
    try:
        module = cpp_extension.load(
            name, [str(_SOURCE)], extra_cflags=["-O3"], build_directory=str(folder), with_cuda=False, verbose=False
        )
    except (RuntimeError, OSError, ImportError) as exc:
        raise RuntimeError(f"building {_SOURCE.name} failed: {str(exc).strip()[-500:]}") from None
    record.write_text(_sha256(library))
    return module


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def status() -> Availability:
    """Whether eager calls go through the C++ tables here (built on first call); the reason if not."""
    if not settings.fast_calls_enabled():
        return Availability(False, "the Python path: MXGEMM_FAST_CALLS turns the C++ calls off")
    try:
        extension()
    except RuntimeError as exc:
        logger.warning("mxgemm: eager calls take the Python path, the C++ calls are not built: %s", exc)
        return Availability(False, f"the Python path: the C++ calls are not built ({exc})")
    return Availability(True, "from C++ to the launch once the Python path made M's plan (csrc/fast_call.cpp)")


def register(weight, m: int, dtype: torch.dtype, plan) -> None:
    """Put ``plan``, just made by the Python path for M rows of ``dtype`` on ``weight`` (a :class:`PreparedWeight`; a
    plan of ``Backend.plan`` or a route of ``Backend.run_gated``), into the weight's table where it is a
    :class:`~mxgemm.kernels.Launch` with an ``entry`` and the activations are bf16, if the extension runs here; the
    table keeps the plan alive."""
    entry = plan.entry if isinstance(plan, Launch) else None
    if entry is None or dtype != torch.bfloat16 or not status():
        return
    table = weight.fast
    if table is None:
        table = extension().Table(weight.device, weight.in_features, weight.out_features)
        object.__setattr__(weight, "fast", table)
    table.add(m, *entry, tuning.generation(), plan)
