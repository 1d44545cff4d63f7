"""What mxgemm reads of a model folder: regular files inside it, named as files of the folder.

A model folder's contents are not trusted (a downloaded checkpoint, another user's folder). Its files are read only
where they are regular files inside the folder; a symbolic link is followed only to a regular file inside the folder,
or, for a folder of Hugging Face's cache (``.../snapshots/<revision>``), inside its repository's folder, where the
snapshot's links point (``../../blobs/<hash>``). A shard name from an index names a file of the folder itself (no
separators, no ``..``). Anything else (a link leading out, a FIFO or device, a link to a folder) is refused with
:class:`ModelFolderError` naming the file.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from .cache import read_regular
from .errors import MXGemmError

__all__ = ["ModelFolderError", "copy_side_files", "folder_file", "folder_root", "read_folder_file", "regular_file"]


class ModelFolderError(MXGemmError, ValueError):
    """A file of a model folder that mxgemm does not read: it leads out of the folder or is not a regular file."""


def folder_root(folder: Path) -> Path:
    """Where links of ``folder`` may lead: the folder, or the repository folder of a Hugging Face cache snapshot."""
    folder = Path(os.path.realpath(folder))
    return folder.parent.parent if folder.parent.name == "snapshots" else folder


def regular_file(path: Path, root: Path) -> Path:
    """``path`` if it is a regular file inside ``root``, or a link to one; raises :class:`ModelFolderError`."""
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(root):
        raise ModelFolderError(f"{path} leads out of the model folder (to {real}): not read")
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        raise ModelFolderError(f"{path} cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(mode):
        raise ModelFolderError(f"{path} is not a regular file: not read")
    return path


def read_folder_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, a file of a model folder checked by :func:`regular_file` (a config, an index)."""
    regular_file(path, folder_root(Path(path).parent))
    return read_regular(Path(os.path.realpath(path)), max_bytes)


def folder_file(folder: Path, name: object) -> Path:
    """The file ``name`` (a shard name from an index) of ``folder``, checked by :func:`regular_file`."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ModelFolderError(f"{folder}: the index names {name!r}, which is not a file name of the folder")
    return regular_file(Path(folder) / name, folder_root(folder))


def copy_side_files(src: Path, dst: Path, skip) -> list[str]:
    """Copy ``src``'s files and subfolders into the folder ``dst`` (the files' contents, each checked by
    :func:`regular_file`; a link to a folder refused), leaving out top-level entries for which ``skip(path)`` is
    true. Returns the names copied at the top level."""
    root = folder_root(src)
    copied = []
    for entry in sorted(Path(src).iterdir()):
        if skip(entry):
            continue
        _copy(entry, dst / entry.name, root)
        copied.append(entry.name)
    return copied


def _copy(path: Path, dst: Path, root: Path) -> None:
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode):
        dst.mkdir()
        for entry in sorted(path.iterdir()):
            _copy(entry, dst / entry.name, root)
        return
    if stat.S_ISLNK(mode) and Path(os.path.realpath(path)).is_dir():
        raise ModelFolderError(f"{path} is a link to a folder: not copied")
    shutil.copy2(regular_file(path, root), dst)
