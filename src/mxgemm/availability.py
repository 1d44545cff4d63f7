"""The answer every capability check gives (a backend's, a kernel library's): available or not, with a reason a user
can act on either way. A leaf module: the kernel bindings and the backends both answer with it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Availability"]


@dataclass(frozen=True)
class Availability:
    """A check's answer: ``available`` and, either way, a reason a user can act on."""

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available
