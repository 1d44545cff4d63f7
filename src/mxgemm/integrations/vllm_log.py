"""mxgemm's lines in a vLLM process: through a child of vLLM's root logger, which vLLM gives its handler, so they
show where vLLM's own do (mxgemm's logger has no handler in a vLLM process)."""

from __future__ import annotations

import functools
import logging

__all__ = ["say_once"]

engine_logger = logging.getLogger("vllm.mxgemm")


@functools.cache
def say_once(message: str) -> None:
    """``message`` at INFO through vLLM's logging, once per process."""
    engine_logger.info(message)
