"""torchao: ``quantize_(model, MXFP8LinearConfig())`` replaces each ``nn.Linear`` (torchao's default filter) by an
``MXFP8Linear`` quantized online, through torchao's ``register_quantize_module_handler``. Layers whose
``in_features`` is not a multiple of 32 stay as they are, as with :func:`mxgemm.quantize_model`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from ..linear import MXFP8Linear
from ..models import skip_reason

__all__ = ["MXFP8LinearConfig"]

logger = logging.getLogger("mxgemm")


@dataclass
class MXFP8LinearConfig(AOBaseConfig):
    """What each layer becomes: ``backend`` and ``recipe`` as for :class:`mxgemm.MXFP8Linear` (None: mxgemm resolves
    them for the device), ``scale_mode`` the MX scale rule ("floor", "rceil" or "compressed-tensors")."""

    backend: str | None = None
    recipe: str | None = None
    scale_mode: str = "floor"


@register_quantize_module_handler(MXFP8LinearConfig)
def _to_mxfp8_linear(module: nn.Module, config: MXFP8LinearConfig) -> nn.Module:
    if type(module) is not nn.Linear:
        raise TypeError(f"MXFP8LinearConfig quantizes nn.Linear layers, got {type(module).__name__}")
    reason = skip_reason("", module, ())
    if reason:
        logger.info("mxgemm: %s: layer left as is", reason)
        return module
    return MXFP8Linear.from_linear(module, backend=config.backend, scale_mode=config.scale_mode, recipe=config.recipe)
