"""The output folder of a command that writes one (``mxgemm quantize``): written in a private staging folder beside
it, moved into place only when complete, and given the user's umask then. A staging folder carries the id of the
process writing it, so that a later run finds the ones of processes that no longer exist (a run killed by a signal
that could not be handled) and removes them."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["move_into_place", "remove_stale_staging", "staging_folder"]


def staging_folder(out: Path) -> Path:
    """A new private folder beside ``out`` (``.<name>.<pid>.<random>.tmp``), for the output to be written into."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{os.getpid()}.", suffix=".tmp", dir=out.parent))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_staging(out: Path) -> list[Path]:
    """Remove the staging folders of ``out`` left by processes that no longer exist (folders of this user, not
    links); returns them. A folder of a process still running is left alone: it may be writing now."""
    removed = []
    prefix = f".{out.name}."
    if not out.parent.is_dir():
        return removed
    for path in out.parent.iterdir():
        name = path.name
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid = name[len(prefix) :].split(".", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        info = path.lstat()
        if path.is_symlink() or not path.is_dir() or info.st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def move_into_place(staging: Path, out: Path) -> None:
    """Put the finished folder at ``out``: a rename, the old folder (if any) moved aside first and removed after; then
    its mode follows the umask (the staging folder was private)."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    try:
        os.replace(staging, out)
    except OSError:
        if old is not None:
            os.replace(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    umask = os.umask(0)
    os.umask(umask)
    out.chmod(0o777 & ~umask)
