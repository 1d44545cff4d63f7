"""Autotuning: which tactic of the resolved backend runs a problem, kept in an on-disk JSON cache.

* Only the backend that was resolved is tuned, and only if it has tactics (``Backend.tunable``). Its first tactic is
  the default and always valid; a tactic that fails or is invalid scores infinity, is counted, and is never chosen.
* Key: op, backend, M bucket (a runtime M maps *up* to the next bucket), N, K, activation dtype, weight layout,
  recipe. The file records mxgemm, torch, triton and CUDA versions, the GPU and a digest of the kernels' sources; a
  file whose record differs is not used and not overwritten (said once, on logger ``mxgemm``). A recorded tactic is
  used only where it equals one the backend offers for its bucket now (as :meth:`Tactic.json` writes it).
* The cache is ``$MXGEMM_CACHE_DIR/tuning-<gpu>-<environment>.json`` (default ``~/.cache/mxgemm``; ``<environment>``
  a digest of the environment record, so that each environment keeps a file of its own, an upgrade included);
  writes merge under a file lock and replace the file atomically, so several processes may tune at once. Files
  shipped in ``mxgemm/tuned/`` are read when the user's cache has no entry. ``TuningCache.describe`` says whether a
  file is used, and why not (``mxgemm info`` prints it).
* Determinism: a tactic replaces the default only when it is faster by ``margin`` (above the timing noise) in two
  timings of both; ties keep the earlier tactic. For a given cache the same tactic runs every time.
* Timing as DESIGN.md asks: CUDA-graph replay, the weight rotated through copies beyond 3x the L2, median.
* Never during CUDA-graph capture; on the hot path only with ``MXGEMM_AUTOTUNE=1``; otherwise lookups only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from . import fastcall, settings
from .backends import Backend, PreparedWeight
from .backends.base import tactic_json
from .cache import cache_root, locked
from .device import DeviceInfo, describe_device

__all__ = ["BUCKETS", "Autotuner", "TuneKey", "TuneResult", "TuningCache", "bucket", "environment_metadata"]

logger = logging.getLogger("mxgemm")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_MARGIN = 0.03  # a tactic must be 3% faster than the default: above the spread of repeated timings


def bucket(m: int) -> int:
    """The tuned bucket a runtime M maps to: the smallest bucket >= M (the largest bucket beyond it)."""
    return min(1 << max(m - 1, 0).bit_length(), BUCKETS[-1])  # the buckets are the powers of two


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
    def of(cls, backend: str, weight: PreparedWeight, m: int, x_dtype: torch.dtype) -> TuneKey:
        layout = ",".join(f"{name}:{str(t.dtype).removeprefix('torch.')}" for name, t in weight.tensors.items())
        return cls("linear", backend, bucket(m), weight.out_features, weight.in_features,
                   str(x_dtype).removeprefix("torch."), layout, weight.recipe)  # fmt: skip

    def __str__(self) -> str:
        return "|".join(str(v) for v in (self.op, self.backend, f"m{self.m_bucket}", f"n{self.n}", f"k{self.k}",
                                           self.x_dtype, self.layout, self.recipe))  # fmt: skip


def environment_metadata(device: DeviceInfo) -> dict[str, Any]:
    import importlib.metadata as md

    from . import __version__
    from .kernels import source_digest

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
    return cache_root() / f"tuning-{_slug(device)}-{hashlib.sha256(record).hexdigest()[:12]}.json"


def shipped_cache_path(device: DeviceInfo) -> Path:
    return Path(__file__).parent / "tuned" / f"tuning-{_slug(device)}.json"


class TuningCache:
    """One tuning file: entries keyed by :class:`TuneKey` strings, under an environment record."""

    def __init__(self, path: Path, metadata: dict[str, Any]):
        self.path = Path(path)
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
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as exc:
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
                self.path, data.get("metadata"), self.metadata,
            )  # fmt: skip
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
            logger.warning("mxgemm: cannot write tuning file %s (%s): tuned tactics kept for this process", self.path,
                           exc)  # fmt: skip


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


@dataclass(frozen=True)
class TuneResult:
    key: TuneKey
    tactic: Any  # the chosen tactic (the default when none beats it by the margin)
    default_us: float
    best_us: float
    failed: int
    timed: int
    is_default: bool

    @property
    def speedup(self) -> float:
        return self.default_us / self.best_us if self.best_us else float("nan")


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Autotuner:
    """Chooses tactics from the cache (user file, then shipped file) and tunes on request."""

    def __init__(
        self,
        cache: TuningCache,
        *,
        shipped: TuningCache | None = None,
        timer: Callable[[Callable[[], object]], float] | None = None,
        margin: float = DEFAULT_MARGIN,
    ):
        self.cache = cache
        self.shipped = shipped
        self.timer = timer
        self.margin = margin
        self._memo: dict[tuple, Any] = {}  # lookups by (backend, weight meta, bucket, dtype); cleared on tuning

    @classmethod
    def for_device(cls, device: DeviceInfo | None = None) -> Autotuner:
        device = device or describe_device()
        meta = environment_metadata(device)
        shipped_path = shipped_cache_path(device)
        shipped = TuningCache(shipped_path, meta) if shipped_path.exists() else None
        return cls(TuningCache(default_cache_path(device), meta), shipped=shipped)

    def choice(self, backend: Backend, weight: PreparedWeight, m: int, x_dtype: torch.dtype) -> tuple[Any, str]:
        """(tactic, where it comes from: ``"cache"``, ``"shipped"`` or ``"default"``, whose tactic is None);
        memoized, as calls ask every time."""
        if not backend.tunable:
            return None, "default"
        memo_key = (backend.name, weight.op_meta, bucket(m), x_dtype)
        if memo_key not in self._memo:
            key = TuneKey.of(backend.name, weight, m, x_dtype)
            files = [(c, src) for c, src in ((self.cache, "cache"), (self.shipped, "shipped")) if c is not None]
            choice = None, "default"
            for cache, src in files:
                record = cache.get(key)
                if record is None:
                    continue
                tactic = self._known(backend, weight, key.m_bucket, record["tactic"])
                if tactic is not None:
                    choice = tactic, src
                    break
                logger.warning("mxgemm: tuning file %s: tactic %s for %s is not one %s has now; ignored",
                               cache.path, record["tactic"], key, backend.name)  # fmt: skip
            self._memo[memo_key] = choice
        return self._memo[memo_key]

    @staticmethod
    def _known(backend: Backend, weight: PreparedWeight, m_bucket: int, recorded: Any) -> Any:
        """The tactic the backend offers for this bucket now that a file records as ``recorded``, or None (a file
        edited by hand, or from kernels whose tactics differ, may hold others)."""
        try:
            return next((t for t in backend.tactics(m_bucket, weight) if tactic_json(t) == recorded), None)
        except Exception:  # a tactic list that cannot be made: follow nothing from the file
            return None

    def lookup(self, backend: Backend, weight: PreparedWeight, m: int, x_dtype: torch.dtype) -> Any:
        """The cached tactic for this problem, or None (the backend's default)."""
        return self.choice(backend, weight, m, x_dtype)[0]

    def tune(
        self, backend: Backend, weight: PreparedWeight, m: int, x_dtype: torch.dtype, *, write: bool = True
    ) -> TuneResult | None:
        """Time every tactic of ``backend`` for this problem at its M bucket and record the choice.

        Returns None (and times nothing) for backends without tactics or during CUDA-graph capture.
        """
        if not backend.tunable or _capturing():
            return None
        key = TuneKey.of(backend.name, weight, m, x_dtype)
        mb = key.m_bucket
        x = torch.randn(mb, weight.in_features, device=weight.device).to(x_dtype)
        tactics: Sequence[Any] = backend.tactics(mb, weight)
        timer = self.timer or _default_timer
        copies = _cold_copies(weight)
        failed = 0
        if self.timer is None and weight.device.type == "cuda":  # the copies were just written: let them settle
            from .timing import settle

            try:
                settle(lambda: [backend.run(x, w, None, tactic=tactics[0]) for w in copies])
            except Exception as exc:  # the default tactic failing is reported by its measurement below
                logger.debug("mxgemm: settling %s failed: %s", key, exc)

        def measure(tactic: Any) -> float:
            nonlocal failed
            try:
                calls = lambda: [backend.run(x, w, None, tactic=tactic) for w in copies]  # noqa: E731
                return timer(calls) / len(copies)
            except Exception as exc:  # an invalid tactic scores infinity and is counted, never chosen
                logger.debug("mxgemm: tactic %s failed for %s: %s", tactic, key, exc)
                failed += 1
                return math.inf

        with backend.tuning_context(weight):
            times = [measure(tactic) for tactic in tactics]
            best = min(range(len(times)), key=lambda i: (times[i], i))
            chosen = 0
            if best and times[best] < times[0] * (1 - self.margin):
                # confirmed by a second timing of both: one slow reading of the default must not replace it (the
                # first shipped H200 file's default timings were 4-14% above later ones)
                times[0], times[best] = measure(tactics[0]), measure(tactics[best])
                chosen = best if times[best] < times[0] * (1 - self.margin) else 0
        result = TuneResult(key, tactics[chosen], times[0], times[chosen], failed, len(tactics), chosen == 0)
        if write:
            record = {
                "tactic": tactic_json(result.tactic),
                "us": result.best_us,
                "default_us": result.default_us,
                "failed": failed,
            }
            self.cache.put({str(key): record})
            self._memo.clear()
            _GENERATION[0] += 1
            fastcall.tuning_changed(_GENERATION[0])
        return result


def _cold_copies(weight: PreparedWeight) -> list[PreparedWeight]:
    """The weight and enough copies of it that a round over them exceeds 3x the L2 (on a GPU): tactics are timed
    with the weight read from memory, as in real use, not from L2."""
    if weight.device.type != "cuda":
        return [weight]
    from .timing import copies_for_cold_l2

    nbytes = sum(t.numel() * t.element_size() for t in weight.tensors.values())
    count = copies_for_cold_l2(nbytes, describe_device(weight.device).l2_bytes)

    def clone() -> PreparedWeight:  # op tensors and meta recomputed from the cloned tensors
        tensors = {n: t.clone() for n, t in weight.tensors.items()}
        return replace(weight, tensors=tensors, op_tensors=None, op_meta=None, plans={})

    return [weight] + [clone() for _ in range(count - 1)]


def _default_timer(fn: Callable[[], object]) -> float:
    from .timing import time_cpu, time_cuda

    if torch.cuda.is_available():
        return time_cuda([fn], replays=10, replay_ms=1.0)
    return time_cpu(fn, repeats=3)


_TUNERS: dict[Any, Autotuner] = {}
_GENERATION = [0]  # bumped whenever a tuner writes: eager launch plans made before it are stale


def generation() -> int:
    """How many times tuning has changed a cache in this process (part of the key of eager launch plans)."""
    return _GENERATION[0]


def tuner_for(device: torch.device) -> Autotuner:
    """The process-wide tuner of a device (created on first use: reads the cache files once)."""
    key = (device.type, device.index)
    if key not in _TUNERS:
        _TUNERS[key] = Autotuner.for_device(describe_device(device))
    return _TUNERS[key]


def tactic_for_call(backend: Backend, weight: PreparedWeight, x: torch.Tensor) -> Any:
    """The tactic a call runs with: cached, or tuned now when ``MXGEMM_AUTOTUNE=1`` (never during capture)."""
    if not backend.tunable:
        return None
    tuner = tuner_for(x.device)
    tactic = tuner.lookup(backend, weight, x.shape[0], x.dtype)
    if tactic is None and settings.autotune_enabled() and not _capturing():
        result = tuner.tune(backend, weight, x.shape[0], x.dtype)
        tactic = result.tactic if result else None
    return tactic
