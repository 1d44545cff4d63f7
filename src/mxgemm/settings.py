"""Every environment variable mxgemm reads, parsed in one place: a bad value raises :class:`SettingsError` naming the
variable and what it accepts, never a silent default."""

from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import MXGemmError

__all__ = [
    "SettingsError",
    "autotune_enabled",
    "backend_request",
    "cache_dir",
    "fast_calls_enabled",
    "problems",
    "reencode_max_error",
]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingsError(MXGemmError, ValueError):
    """An environment variable holds a value mxgemm does not accept."""


def _flag(name: str, default: bool = False) -> bool:
    """The switch ``name``: ``default`` where it is unset or blank."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}={os.environ[name]!r} is not a switch; use 1/true/yes/on or 0/false/no/off")


def backend_request() -> str:
    """``MXGEMM_BACKEND``: a backend name or ``auto`` (the default); the name is checked where it is resolved, and
    an unknown one named as this variable's (:func:`mxgemm.resolve.default_request`)."""
    return os.environ.get("MXGEMM_BACKEND", "").strip() or "auto"


def problems() -> list[str]:
    """What is wrong with the variables set now, one line each (``mxgemm info`` shows them): every reader is tried."""
    found = []
    for read in (autotune_enabled, fast_calls_enabled, eager_graphs_enabled, reencode_max_error, cache_dir):
        try:
            read()
        except SettingsError as exc:
            found.append(str(exc))
    return found


def autotune_enabled() -> bool:
    """``MXGEMM_AUTOTUNE``: whether a call whose problem is not in the tuning cache tunes it first (default off)."""
    return _flag("MXGEMM_AUTOTUNE")


def fast_calls_enabled() -> bool:
    """``MXGEMM_FAST_CALLS``: whether eager calls of planned kernels go from C++ to the launch (default on)."""
    return _flag("MXGEMM_FAST_CALLS", default=True)


def eager_graphs_enabled() -> bool:
    """``MXGEMM_EAGER_GRAPHS``: whether eager calls of the experts' routed block, and of the MoE blocks holding them,
    replay CUDA graphs (default on)."""
    return _flag("MXGEMM_EAGER_GRAPHS", default=True)


def reencode_max_error() -> float:
    """``MXGEMM_REENCODE_MAX_ERROR``: the largest relative error of a 128x128 re-encoding accepted (default 1e-5)."""
    raw = os.environ.get("MXGEMM_REENCODE_MAX_ERROR", "").strip()
    if not raw:
        return 1e-5
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise SettingsError(f"MXGEMM_REENCODE_MAX_ERROR={raw!r} must be a finite number >= 0 (e.g. 1e-5)")
    return value


def cache_dir() -> Path:
    """``MXGEMM_CACHE_DIR``: where tuning files and built kernels live (default ``~/.cache/mxgemm``); ``~`` is the
    user's home, as in a shell."""
    raw = os.environ.get("MXGEMM_CACHE_DIR", "").strip()
    return Path(os.path.expanduser(raw)) if raw else Path.home() / ".cache" / "mxgemm"
