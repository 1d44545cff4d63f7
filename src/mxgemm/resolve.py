"""The one place that decides which backend runs. Nothing else overrides its answer."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from .backends import AUTO_PRIORITY, RECIPES, Availability, Backend, backend_names, get_backend
from .device import DeviceInfo, describe_device
from .errors import BackendUnavailableError

__all__ = ["BackendStatus", "Resolution", "available_backends", "default_request", "explain_auto", "resolve_backend"]

logger = logging.getLogger("mxgemm")
ENV_BACKEND = "MXGEMM_BACKEND"
DeviceLike = DeviceInfo | torch.device | str | int | None


@dataclass(frozen=True)
class BackendStatus:
    """One row of :func:`available_backends`."""

    name: str
    available: bool
    reason: str
    recipes: tuple[str, ...]


@dataclass(frozen=True)
class Resolution:
    backend: Backend
    recipe: str
    skipped: tuple[tuple[str, str], ...]  # (name, reason) of the backends `auto` passed over, in order


def default_request() -> str:
    """The backend asked for when none is named: ``$MXGEMM_BACKEND``, else ``auto``."""
    return os.environ.get(ENV_BACKEND, "").strip() or "auto"


def _check(backend: Backend, device: DeviceInfo, recipe: str | None, shape: tuple[int, int] | None) -> Availability:
    if recipe is not None and recipe not in backend.recipes:
        return Availability(False, f"computes {'/'.join(backend.recipes)}, not the requested recipe {recipe}")
    answer = backend.check_device(device)
    if answer and shape is not None:
        answer = backend.check_problem(*shape)
    return answer


def _validate_recipe(recipe: str | None) -> None:
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; valid recipes: {', '.join(RECIPES)}")


def available_backends(
    device: DeviceLike = None, *, recipe: str | None = None, shape: tuple[int, int] | None = None
) -> list[BackendStatus]:
    """Every registered backend, available here or not, with the reason."""
    _validate_recipe(recipe)
    dev = describe_device(device)
    rows = []
    for name in backend_names():
        b = get_backend(name)
        answer = _check(b, dev, recipe, shape)
        rows.append(BackendStatus(name, answer.available, answer.reason, b.recipes))
    return rows


def explain_auto(
    device: DeviceLike = None, *, recipe: str | None = None, shape: tuple[int, int] | None = None
) -> Resolution:
    """What ``auto`` picks and why it passed over the backends before it."""
    _validate_recipe(recipe)
    dev = describe_device(device)
    skipped = []
    for name in AUTO_PRIORITY:
        b = get_backend(name)
        answer = _check(b, dev, recipe, shape)
        if answer:
            return Resolution(b, recipe or b.default_recipe, tuple(skipped))
        skipped.append((name, answer.reason))
    detail = "; ".join(f"{n}: {r}" for n, r in skipped)
    raise BackendUnavailableError("auto", f"no backend can run on {dev}: {detail}")


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def resolve_backend(
    requested: str | None = None,
    *,
    device: DeviceLike = None,
    recipe: str | None = None,
    shape: tuple[int, int] | None = None,
) -> Backend:
    """Resolve a backend request to the backend that will run.

    ``requested``: a backend name or ``"auto"``; None reads ``$MXGEMM_BACKEND`` (default ``auto``).
    ``device``: a device, or a :class:`DeviceInfo` to pretend to be one. ``recipe``: only backends computing it.
    ``shape``: ``(out_features, in_features)`` of the weight, checked against the backend's shape constraints.

    An explicit backend either passes every check or raises :class:`BackendUnavailableError` with the reason: there
    is never a silent fallback. ``auto`` takes the first backend of ``AUTO_PRIORITY`` whose checks pass and logs
    (logger ``mxgemm``, INFO) what it chose and why it skipped the ones before it.
    """
    requested = requested or default_request()
    if requested == "auto":
        res = explain_auto(device, recipe=recipe, shape=shape)
        skipped = "; ".join(f"{n} ({r})" for n, r in res.skipped) or "nothing"
        _log_once(f"auto chose '{res.backend.name}' ({res.recipe}) on {describe_device(device)}; skipped {skipped}")
        return res.backend
    backend = get_backend(requested)
    _validate_recipe(recipe)
    answer = _check(backend, describe_device(device), recipe, shape)
    if not answer:
        raise BackendUnavailableError(requested, answer.reason)
    return backend
