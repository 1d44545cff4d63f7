"""mxgemm's per-user cache folders (tuning files, built kernels, the C++ extension), the file lock its writers share,
and reads of files that may have been planted.

Nothing in a cache folder is loaded or written unless the folder is one only this user (or root) can change: a real
folder (not a symbolic link), owned by this user or root, writable by no one else, under ancestors that others cannot
rename it out of (owned by this user or root, writable by others only with the sticky bit, as ``/tmp``). Group write
permission counts as others' unless the group is this user's private one.
:func:`private_dir` makes such folders (mode 0700) and refuses the others with :class:`UnsafeFolderError`, whose
message says what is wrong; callers then use the next folder or none. Lock files are opened without following links.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from .errors import MXGemmError

logger = logging.getLogger("mxgemm")
_T = TypeVar("_T")

__all__ = [
    "UnsafeFileError",
    "UnsafeFolderError",
    "build_in_cache",
    "cache_folders",
    "check_trusted_dir",
    "locked",
    "private_dir",
    "read_regular",
    "temp_root",
]


class UnsafeFolderError(MXGemmError, PermissionError):
    """A cache folder that another user could change: nothing in it is loaded or written."""


class UnsafeFileError(MXGemmError, OSError):
    """A file that is not a regular file (a link, FIFO, device or folder), or larger than what is read of it."""


def temp_root() -> Path:
    """This user's cache folder under the system's temporary directory (``mxgemm-<uid>``)."""
    return Path(tempfile.gettempdir()) / f"mxgemm-{os.getuid()}"


def cache_folders(sub: str) -> list[Path]:
    """Where builds of kind ``sub`` live, in the order they are tried: the user's cache, then this user's private
    folder under the system's temporary directory (for a cache that cannot be written or is refused). Each is
    checked where it is used (:func:`private_dir`, :func:`locked`)."""
    from .settings import cache_dir

    return [cache_dir() / sub, temp_root() / sub]


def build_in_cache(sub: str, what: str, build: Callable[[Path], _T]) -> _T:
    """``build(folder)`` in the first of :func:`cache_folders` (``sub``) where it raises no OSError: a folder other
    users could change (:class:`UnsafeFolderError`) is named on the ``mxgemm`` logger and passed over, as is one that
    cannot be written. Raises RuntimeError naming each folder and why where none serves ``what``."""
    refused = []
    for folder in cache_folders(sub):
        try:
            return build(folder)
        except UnsafeFolderError as exc:
            logger.warning("mxgemm: %s", exc)
            refused.append(str(exc))
        except OSError as exc:
            refused.append(f"{folder} ({exc.strerror or exc})")
    raise RuntimeError(f"no folder to build {what} in: {'; '.join(refused)}")


def _trusted_owner(st: os.stat_result) -> bool:
    return st.st_uid in (os.getuid(), 0)


@functools.cache
def _own_private_group(gid: int) -> bool:
    """Whether ``gid`` is this user's private group (named after the user, no other members: the convention under
    which a umask of 002 makes folders group-writable), whose write permission lets no one else in."""
    import grp
    import pwd

    try:
        user, group = pwd.getpwuid(os.getuid()).pw_name, grp.getgrgid(gid)
    except KeyError:
        return False
    return gid == os.getgid() and group.gr_name == user and set(group.gr_mem) <= {user}


def _others_can_write(st: os.stat_result) -> bool:
    if st.st_mode & 0o002:
        return True
    return bool(st.st_mode & 0o020) and not _own_private_group(st.st_gid)


def check_trusted_dir(path: Path) -> None:
    """Raise :class:`UnsafeFolderError` unless ``path`` is a folder only this user or root can change (module doc)."""
    path = Path(os.path.abspath(path))
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFolderError(f"{path} is a symbolic link, not a folder of this user's: not used")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolderError(f"{path} is not a folder")
    if not _trusted_owner(st):
        raise UnsafeFolderError(f"{path} is owned by user {st.st_uid}, not by this user ({os.getuid()}): not used")
    if _others_can_write(st):
        raise UnsafeFolderError(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): not used")
    for parent in path.parents:
        for st in (os.lstat(parent), os.stat(parent)):  # a link in the path, and what it points to
            if not _trusted_owner(st) or (_others_can_write(st) and not st.st_mode & stat.S_ISVTX):
                raise UnsafeFolderError(f"{path} lies under {parent}, which other users can change: not used")


def private_dir(path: Path) -> Path:
    """``path`` made (mode 0700, missing parents too) or found, and checked by :func:`check_trusted_dir`."""
    path = Path(os.path.abspath(path))
    for folder in [*reversed(path.parents), path]:
        if not os.path.lexists(folder):
            with contextlib.suppress(FileExistsError):  # made by another process meanwhile: checked below
                os.mkdir(folder, 0o700)
    check_trusted_dir(path)
    return path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``<path>.lock`` (across processes) while the block runs. The lock file's folder is
    made private and checked first; the file is opened without following a link and never truncated. A lock dies with
    its process: a killed holder leaves nothing that blocks the next one."""
    import fcntl

    private_dir(path.parent)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path.with_suffix(path.suffix + ".lock"), flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path`` if it is a regular file (not a link, FIFO or device) of at most ``max_bytes``; raises
    FileNotFoundError where there is none and :class:`UnsafeFileError` otherwise. Never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path} is a symbolic link: not read") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{path} is not a regular file")
        if st.st_size > max_bytes:
            raise UnsafeFileError(f"{path} holds {st.st_size} bytes, more than the {max_bytes} read of such a file")
        return f.read(max_bytes + 1)[:max_bytes]
