"""Exception types raised by mxgemm. Each message says what to change."""

from __future__ import annotations

__all__ = ["BackendUnavailableError", "MXGemmError", "UnknownBackendError"]


class MXGemmError(Exception):
    """Base class of every mxgemm error."""


class UnknownBackendError(MXGemmError, ValueError):
    """A backend name that mxgemm does not know."""


class BackendUnavailableError(MXGemmError, RuntimeError):
    """A named backend cannot run here; the message carries its own reason."""

    def __init__(self, backend: str, reason: str):
        self.backend = backend
        self.reason = reason
        super().__init__(f"backend '{backend}' cannot run here: {reason}")
