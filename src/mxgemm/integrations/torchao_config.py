"""torchao: ``quantize_(model, MXFP8LinearConfig())`` replaces each ``nn.Linear`` (torchao's default filter) by an
``MXFP8Linear`` quantized online, through torchao's ``register_quantize_module_handler``. Layers whose
``in_features`` is not a multiple of 32 stay as they are, as with :func:`mxgemm.quantize_model`.

A mixture of experts: ``quantize_(model, MXFP8LinearConfig(), filter_fn=moe_filter(model))`` also replaces each
experts module :class:`mxgemm.MXFP8Experts` takes (transformers' 3-D experts) and keeps the routers in full
precision, as ``quantize_model`` does (torchao's default filter would take the routers' ``nn.Linear`` and never
reach the experts)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from ..linear import MXFP8Linear
from ..models import router_names, skip_reason
from ..moe import MXFP8Experts, experts_modules, experts_unfit_reason, is_experts_module
from ..resolve import check_request

__all__ = ["MXFP8LinearConfig", "moe_filter"]

logger = logging.getLogger("mxgemm")


@dataclass
class MXFP8LinearConfig(AOBaseConfig):
    """What each layer becomes: ``backend`` and ``recipe`` as for :class:`mxgemm.MXFP8Linear` (None: mxgemm resolves
    them for the device), ``scale_mode`` the MX scale rule ("floor", "rceil" or "compressed-tensors")."""

    backend: str | None = None
    recipe: str | None = None
    scale_mode: str = "floor"

    def __post_init__(self):
        check_request(self.backend, self.recipe, self.scale_mode)


def moe_filter(model: nn.Module):
    """torchao's ``filter_fn`` for a model with mixtures of experts: its ``nn.Linear`` layers but the routers, and its
    experts modules (each one :class:`mxgemm.MXFP8Experts` takes; one it cannot is left, and logged with why)."""
    routers = router_names(model)
    experts = {id(m) for _, m in experts_modules(model)}

    def take(module: nn.Module, fqn: str) -> bool:
        return (type(module) is nn.Linear and fqn not in routers) or id(module) in experts

    return take


@register_quantize_module_handler(MXFP8LinearConfig)
def _to_mxfp8_linear(module: nn.Module, config: MXFP8LinearConfig) -> nn.Module:
    options = {"backend": config.backend, "scale_mode": config.scale_mode, "recipe": config.recipe}
    if is_experts_module(module):
        reason = experts_unfit_reason(module)
        if reason:
            logger.info("mxgemm: %s: experts module left as is", reason)
            return module
        return MXFP8Experts.from_experts(module, **options)
    if type(module) is not nn.Linear:
        what = type(module).__name__
        raise TypeError(f"MXFP8LinearConfig quantizes nn.Linear layers and experts modules, got {what}")
    reason = skip_reason("", module, ())
    if reason:
        logger.info("mxgemm: %s: layer left as is", reason)
        return module
    return MXFP8Linear.from_linear(module, **options)
