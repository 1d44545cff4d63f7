"""The tuning store: which tactic a problem ran fastest with, kept in on-disk JSON files, and the process's tuning
generation. It sits below the backends and the C++ call table, which read it; :mod:`mxgemm.autotune`, above the
backends, times tactics and writes here.

* Key (:class:`TuneKey`): op, backend, M bucket (a runtime M maps *up* to the next bucket), N, K, activation dtype,
  weight layout, recipe.
* A file (:class:`TuningCache`) records the environment (mxgemm, torch, triton and CUDA versions, the GPU and a digest
  of the kernels' sources); a file whose record differs is not used and not overwritten (said once, on logger
  ``mxgemm``). The user's file is ``$MXGEMM_CACHE_DIR/tuning-<gpu>-<environment>.json`` (default
  ``~/.cache/mxgemm``; ``<environment>`` a digest of the record, so each environment keeps a file of its own), read
  only from a folder no other user can change; files shipped in ``mxgemm/tuned/`` are read when it has no entry.
  Writes merge under a file lock and replace the file atomically, so several processes may tune at once.
* The generation (:func:`generation`) counts the times tuning changed a file in this process; launch plans are keyed
  by it, and :func:`changed` tells whoever asked (:func:`on_change`: the C++ call table) the new one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata as md
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import settings
from .cache import check_trusted_dir, locked, read_regular
from .device import DeviceInfo
from .kernels import source_digest
from .version import __version__

__all__ = [
    "BUCKETS",
    "TuneKey",
    "TuningCache",
    "bucket",
    "changed",
    "default_cache_path",
    "environment_metadata",
    "generation",
    "on_change",
    "shipped_cache_path",
]

logger = logging.getLogger("mxgemm")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MAX_FILE_BYTES = 64 << 20  # a tuning file of every bucket of 100 models is under 10 MB


def bucket(m: int) -> int:
    """The tuned bucket a runtime M maps to: the smallest bucket >= M (the largest bucket beyond it)."""
    return min(1 << max(m - 1, 0).bit_length(), BUCKETS[-1])  # the buckets are the powers of two


def grouped_buckets(rows: int, experts: int) -> tuple[int, int]:
    """The tuned buckets of ``rows`` rows over ``experts`` experts, spread evenly: (rows per expert, active experts),
    each the smallest power of two at or above it, the active experts at most ``experts``. Below one row an expert
    the experts a call reads vary with the rows; from there all are read and the rows per expert vary."""
    return bucket(-(-rows // max(experts, 1))), min(bucket(min(rows, experts)), experts)


@dataclass(frozen=True)
class TuneKey:
    op: str
    backend: str
    m_bucket: int
    n: int
    k: int
    x_dtype: str
    layout: str
    recipe: str

    @classmethod
    def of(cls, backend: str, weight, m: int, x_dtype: torch.dtype) -> TuneKey:
        """The key of ``weight`` (a prepared weight: its tensors, sizes and recipe) at M rows of ``x_dtype``."""
        layout = ",".join(f"{name}:{str(t.dtype).removeprefix('torch.')}" for name, t in weight.tensors.items())
        return cls(
            "linear",
            backend,
            bucket(m),
            weight.out_features,
            weight.in_features,
            str(x_dtype).removeprefix("torch."),
            layout,
            weight.recipe,
        )

    @classmethod
    def grouped(cls, backend: str, weight, rows: int, x_dtype: torch.dtype, op: str = "grouped") -> TuneKey:
        """The key of grouped weights (``PreparedGroupedWeight``) at ``rows`` rows sorted by expert, by what a
        routing spread evenly would be (which experts a routing makes active, and how many rows each gets, are not
        known on the host): the rows per expert, bucketed, and in the layout the expert count and the active experts,
        bucketed (:func:`grouped_buckets`). ``op`` "experts": gate/up's tactic in the routed block, timed on the
        whole block."""
        per, active = grouped_buckets(rows, weight.experts)
        key = cls.of(backend, weight, per, x_dtype)
        layout = f"{key.layout},experts:{weight.experts},active:{active}"
        return dataclasses.replace(key, op=op, layout=layout)

    def __str__(self) -> str:
        return "|".join(
            str(v)
            for v in (
                self.op,
                self.backend,
                f"m{self.m_bucket}",
                f"n{self.n}",
                f"k{self.k}",
                self.x_dtype,
                self.layout,
                self.recipe,
            )
        )


def environment_metadata(device: DeviceInfo) -> dict[str, Any]:
    try:
        triton_version = md.version("triton")
    except md.PackageNotFoundError:
        triton_version = None
    return {
        "mxgemm": __version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "gpu": device.name or device.type,
        "sm": device.sm,
        "kernels": source_digest(),
    }


def _slug(device: DeviceInfo) -> str:
    name = (device.name or device.type).lower().replace("nvidia ", "")
    return "".join(c if c.isalnum() else "-" for c in name).strip("-") + (f"-sm{device.sm}" if device.sm else "")


def default_cache_path(device: DeviceInfo) -> Path:
    """The user's tuning file for this device in this environment (versions, GPU, kernels)."""
    record = json.dumps(environment_metadata(device), sort_keys=True).encode()
    return settings.cache_dir() / f"tuning-{_slug(device)}-{hashlib.sha256(record).hexdigest()[:12]}.json"


def shipped_cache_path(device: DeviceInfo) -> Path:
    return Path(__file__).parent / "tuned" / f"tuning-{_slug(device)}.json"


class TuningCache:
    """One tuning file: entries keyed by :class:`TuneKey` strings, under an environment record."""

    def __init__(self, path: Path, metadata: dict[str, Any], *, packaged: bool = False):
        """``packaged``: a file shipped inside the package (trusted as the Python environment is); any other is read
        only from a folder no other user can change (:func:`mxgemm.cache.check_trusted_dir`)."""
        self.path = Path(path)
        self.packaged = packaged
        self.metadata = metadata
        self.entries: dict[str, dict[str, Any]] = {}
        self.usable = True
        self.status = "absent (tuning writes it: `mxgemm tune`, or calls with MXGEMM_AUTOTUNE=1)"  # see describe()
        self._load()

    def describe(self) -> str:
        """One line for users: the file, and whether its entries are used (and if not, why)."""
        return f"{self.path}: {self.status}"

    def _read(self) -> dict[str, Any] | None:
        try:
            if not self.packaged and self.path.parent.is_dir():
                check_trusted_dir(self.path.parent)
            return json.loads(read_regular(self.path, MAX_FILE_BYTES))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: not UTF-8 or not JSON
            logger.warning("mxgemm: ignoring unreadable tuning file %s: %s", self.path, exc)
            self.status = f"not used: unreadable ({exc})"
            return None

    def _load(self) -> None:
        data = self._read()
        if data is None:
            return
        if not isinstance(data, dict) or not isinstance(data.get("entries", {}), dict):
            self.usable = False
            self.status = "not used: not a tuning file"
            logger.warning("mxgemm: tuning file %s is not a tuning file: not used, not overwritten", self.path)
            return
        if data.get("metadata") != self.metadata:
            self.usable = False
            self.status = f"not used: made for {_differences(data.get('metadata'), self.metadata)}"
            logger.warning(
                "mxgemm: tuning file %s was made for %s, not %s: not used, not overwritten",
                self.path,
                data.get("metadata"),
                self.metadata,
            )
            return
        self.entries = _valid_entries(data.get("entries", {}), self.path)
        self.status = f"{len(self.entries)} entries"

    def get(self, key: TuneKey) -> dict[str, Any] | None:
        """The record of ``key``: from the file, or tuned in this process (kept in memory where the file cannot be
        written, so nothing is tuned twice)."""
        return self.entries.get(str(key))

    def put(self, records: dict[str, dict[str, Any]]) -> None:
        """Merge records into the file (re-read under the lock, so other writers' entries survive). Where the file
        cannot be written (another environment's, a read-only folder, a path that is a file), the records are kept
        for this process only, said once."""
        self.entries.update(records)
        if not self.usable:
            return
        try:
            with locked(self.path):
                data = self._read()
                if data is not None and (not isinstance(data, dict) or data.get("metadata") != self.metadata):
                    self.usable = False
                    return
                entries = _valid_entries((data or {}).get("entries", {}), self.path)
                entries.update(records)
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump({"metadata": self.metadata, "entries": entries}, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
                self.entries = entries
                self.status = f"{len(entries)} entries"
        except OSError as exc:
            self.usable = False
            self.status = f"not written ({exc}): tuned tactics kept for this process"
            logger.warning(
                "mxgemm: cannot write tuning file %s (%s): tuned tactics kept for this process", self.path, exc
            )


def _differences(theirs: Any, ours: dict[str, Any]) -> str:
    """What a file's environment record says where it differs from this environment's."""
    if not isinstance(theirs, dict):
        return f"no environment record ({theirs!r})"
    keys = sorted(set(theirs) | set(ours), key=lambda k: (k not in ours, k))
    return ", ".join(f"{k} {theirs.get(k)} (here {ours.get(k)})" for k in keys if theirs.get(k) != ours.get(k))


def _valid_entries(entries: Any, path: Path) -> dict[str, dict[str, Any]]:
    """The well-formed records of a file's entries (a dict holding a ``tactic``); the others dropped, said once."""
    if not isinstance(entries, dict):
        entries = {}
    good = {k: v for k, v in entries.items() if isinstance(k, str) and isinstance(v, dict) and "tactic" in v}
    if len(good) != len(entries):
        logger.warning("mxgemm: tuning file %s: %d malformed entries ignored", path, len(entries) - len(good))
    return good


_GENERATION = [0]  # bumped whenever tuning changes a file: eager launch plans made before it are stale
_LISTENERS: list[Callable[[int], None]] = []


def generation() -> int:
    """How many times tuning has changed a cache in this process (part of the key of eager launch plans)."""
    return _GENERATION[0]


def on_change(listener: Callable[[int], None]) -> None:
    """Call ``listener(generation)`` each time tuning changes a cache from now on."""
    _LISTENERS.append(listener)


def changed() -> None:
    """Tuning changed a cache: a new generation, told to every listener."""
    _GENERATION[0] += 1
    for listener in _LISTENERS:
        listener(_GENERATION[0])
