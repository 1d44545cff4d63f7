"""The one place that decides which backend runs. Nothing else overrides its answer."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from . import settings
from .backends import (
    AUTO_PRIORITY,
    RECIPES,
    Availability,
    Backend,
    PreparedWeight,
    UnsupportedWeightError,
    backend_names,
    get_backend,
)
from .backends.capabilities import GroupedWeights
from .device import DeviceInfo, describe_device
from .errors import BackendUnavailableError, UnknownBackendError
from .format import SCALE_MODES

__all__ = [
    "BackendStatus",
    "Resolution",
    "available_backends",
    "check_request",
    "default_request",
    "explain_auto",
    "resolve_and_prepare",
    "resolve_backend",
]

logger = logging.getLogger("mxgemm")
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
    """The backend asked for when none is named: ``$MXGEMM_BACKEND``, else ``auto``; an unknown name raises
    :class:`UnknownBackendError` naming the variable."""
    name = settings.backend_request()
    if name != "auto" and name not in backend_names():
        valid = ", ".join(["auto", *backend_names()])
        raise UnknownBackendError(f"MXGEMM_BACKEND={name!r} is not a backend; valid names: {valid}")
    return name


def _recipes(backend: Backend, grouped: bool) -> tuple[str, ...]:
    """The recipes ``backend`` computes: for grouped weights its ``grouped_recipes``, none where it runs none."""
    if not grouped:
        return backend.recipes
    return backend.grouped_recipes if isinstance(backend, GroupedWeights) else ()


def _check(
    backend: Backend, device: DeviceInfo, recipe: str | None, shape: tuple[int, int] | None, grouped: bool = False
) -> Availability:
    recipes = _recipes(backend, grouped)
    if not recipes:
        return Availability(False, "runs dense weights only, not the grouped weights of a mixture of experts")
    if recipe is not None and recipe not in recipes:
        what = "grouped weights in " if grouped else ""
        return Availability(False, f"computes {what}{'/'.join(recipes)}, not the requested recipe {recipe}")
    answer = backend.check_device(device)
    if answer and grouped:
        answer = backend.check_grouped(device)
    if answer and shape is not None:
        answer = backend.check_problem(*shape)
    return answer


def _validate_recipe(recipe: str | None) -> None:
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; valid recipes: {', '.join(RECIPES)}")


def check_request(backend: str | None, recipe: str | None, scale_mode: str | None = None) -> None:
    """Raise, naming what is wrong, for a backend, recipe or MX scale mode mxgemm does not know (None: not given):
    what a config object checks when it is made, not at its first use."""
    if backend is not None and backend != "auto":
        get_backend(backend)  # UnknownBackendError, listing the valid names
    _validate_recipe(recipe)
    if scale_mode is not None and scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {', '.join(SCALE_MODES)}, got {scale_mode!r}")


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
    device: DeviceLike = None,
    *,
    recipe: str | None = None,
    shape: tuple[int, int] | None = None,
    refused: tuple[tuple[str, str], ...] = (),
    grouped: bool = False,
) -> Resolution:
    """What ``auto`` picks and why it passed over the backends before it.

    ``refused``: (name, reason) of backends that already refused this particular weight. ``grouped``: for the
    ``[E, N, K]`` weights of a mixture of experts (backends with :class:`GroupedWeights`).
    """
    _validate_recipe(recipe)
    dev = describe_device(device)
    skipped = []
    refusals = dict(refused)
    for name in AUTO_PRIORITY:
        b = get_backend(name)
        answer = Availability(False, refusals[name]) if name in refusals else _check(b, dev, recipe, shape, grouped)
        if answer:
            return Resolution(b, recipe or _recipes(b, grouped)[0], tuple(skipped))
        skipped.append((name, answer.reason))
    detail = "; ".join(f"{n}: {r}" for n, r in skipped)
    raise BackendUnavailableError("auto", f"no backend can run on {dev}: {detail}")


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def resolve_backend(
    requested: str | None = None,
    *,
    device: DeviceLike = None,
    recipe: str | None = None,
    shape: tuple[int, int] | None = None,
    grouped: bool = False,
) -> Backend:
    """Resolve a backend request to the backend that will run.

    ``requested``: a backend name or ``"auto"``; None reads ``$MXGEMM_BACKEND`` (default ``auto``).
    ``device``: a device, or a :class:`DeviceInfo` to pretend to be one. ``recipe``: only backends computing it.
    ``shape``: ``(out_features, in_features)`` of the weight, checked against the backend's shape constraints.
    ``grouped``: for the ``[E, N, K]`` weights of a mixture of experts (backends with :class:`GroupedWeights`).

    An explicit backend either passes every check or raises :class:`BackendUnavailableError` with the reason: there
    is never a silent fallback. ``auto`` takes the first backend of ``AUTO_PRIORITY`` whose checks pass and logs
    (logger ``mxgemm``, INFO) what it chose and why it skipped the ones before it.
    """
    return _resolve(requested, device=device, recipe=recipe, shape=shape, grouped=grouped)


def _resolve(
    requested: str | None,
    *,
    device: DeviceLike = None,
    recipe: str | None = None,
    shape: tuple[int, int] | None = None,
    refused: tuple[tuple[str, str], ...] = (),
    grouped: bool = False,
) -> Backend:
    requested = requested or default_request()
    if requested == "auto":
        res = explain_auto(device, recipe=recipe, shape=shape, refused=refused, grouped=grouped)
        skipped = "; ".join(f"{n} ({r})" for n, r in res.skipped) or "nothing"
        _log_once(f"auto chose '{res.backend.name}' ({res.recipe}) on {describe_device(device)}; skipped {skipped}")
        return res.backend
    backend = get_backend(requested)
    _validate_recipe(recipe)
    answer = _check(backend, describe_device(device), recipe, shape, grouped)
    if not answer:
        raise BackendUnavailableError(requested, answer.reason)
    return backend


def resolve_and_prepare(
    qdata: torch.Tensor, scale: torch.Tensor, requested: str | None = None, *, recipe: str | None = None
) -> PreparedWeight:
    """Resolve for this weight on its device and prepare it: a dense weight ``[N, K]``, or the grouped weights
    ``[E, N, K]`` of a mixture of experts (backends with :class:`GroupedWeights`). A backend may refuse a weight's
    values (:class:`UnsupportedWeightError`): a named backend then raises :class:`BackendUnavailableError` with the
    reason, while ``auto`` logs it and moves on to the next backend of the priority list."""
    grouped = qdata.dim() == 3
    n, k = qdata.shape[-2:]
    refused: tuple[tuple[str, str], ...] = ()
    while True:
        backend = _resolve(
            requested, device=qdata.device, recipe=recipe, shape=(n, k), refused=refused, grouped=grouped
        )
        try:
            if grouped:
                return backend.prepare_grouped(qdata, scale, recipe or _recipes(backend, True)[0])
            return backend.prepare(qdata, scale, recipe or backend.default_recipe)
        except UnsupportedWeightError as exc:
            if (requested or default_request()) != "auto":
                raise BackendUnavailableError(backend.name, f"this weight: {exc}") from None
            logger.info("auto: '%s' refused a [%d, %d] weight: %s", backend.name, n, k, exc)
            refused = (*refused, (backend.name, f"refused this weight: {exc}"))
