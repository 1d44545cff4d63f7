"""mxgemm's per-user cache folder (tuning files, built kernels) and the file lock its writers share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["cache_root", "locked"]


def cache_root() -> Path:
    """``$MXGEMM_CACHE_DIR``, else ``~/.cache/mxgemm``."""
    from .settings import cache_dir

    return cache_dir()


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (across processes) while the block runs."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(path.suffix + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
