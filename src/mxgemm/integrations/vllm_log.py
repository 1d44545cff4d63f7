"""mxgemm's lines in a vLLM process: through a child of vLLM's root logger, which vLLM gives its handler, so they
show where vLLM's own do (mxgemm's logger has no handler in a vLLM process).

One line says what runs where, once every layer mxgemm took is prepared: vLLM builds the whole model (each layer's
kernel or MoE method, :func:`taken`) before it loads any weight, so by the last :func:`prepared` call every layer is
counted, e.g. ``mxgemm: 96 linear layers on hybrid_sm90 (hybrid-block128); 48 MoE layers on triton (w8a8-block)``,
followed by what was left to vLLM's own kernels and why (:func:`left`)."""

from __future__ import annotations

import functools
import logging
from collections import Counter

__all__ = ["left", "prepared", "say_once", "taken"]

engine_logger = logging.getLogger("vllm.mxgemm")

_taken: Counter[str] = Counter()  # layers mxgemm took, by kind ("linear", "MoE")
_prepared: dict[str, Counter[str]] = {}  # by kind: "backend (recipe)" -> layers prepared on it
_left: dict[str, None] = {}  # what vLLM's own kernels run, and why
_said: list[str] = []  # the line, once said


@functools.cache
def say_once(message: str) -> None:
    """``message`` at INFO through vLLM's logging, once per process."""
    engine_logger.info(message)


def taken(kind: str) -> None:
    """A layer of ``kind`` ("linear", "MoE") that mxgemm runs, counted as vLLM builds it."""
    _taken[kind] += 1


def left(what: str) -> None:
    """Layers left to vLLM's own kernels, and why: said with the line of what mxgemm runs."""
    _left[what] = None


def prepared(kind: str, backend: str, recipe: str) -> None:
    """A layer of ``kind`` prepared on ``backend``; the last of the layers taken says the line (once: layers
    prepared again later, as a refit does, say nothing)."""
    _prepared.setdefault(kind, Counter())[f"{backend} ({recipe})"] += 1
    if not _said and all(sum(_prepared.get(k, Counter()).values()) >= n for k, n in _taken.items()):
        _said.append(summary())
        say_once(_said[0])


def summary() -> str:
    """``mxgemm: <n> <kind> layers on <backend> (<recipe>); ...`` of the layers prepared, then what was left."""
    parts = [
        f"{n} {kind} layer{'s' if n != 1 else ''} on {where}"
        for kind, on in _prepared.items()
        for where, n in on.items()
    ]
    return "mxgemm: " + "; ".join([*parts, *_left])
