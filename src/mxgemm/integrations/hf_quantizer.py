"""transformers: mxgemm as a quantization method of ``from_pretrained``, through transformers' public registration
(``register_quantization_config`` / ``register_quantizer``, method name ``"mxgemm"``), registered on import.

- Online: ``from_pretrained(bf16_or_fp32_model, quantization_config=MXFP8Config(...))`` loads the weights as they are,
  then replaces each ``nn.Linear`` (but the skipped ones) by an ``MXFP8Linear`` quantized from them, layer by layer
  (:func:`mxgemm.quantize_model`). fp32, bf16 and fp16 models work: the layers run in bf16/fp16 and answer in the
  activations' dtype.
- Saved and loaded back: ``save_pretrained`` writes each quantized layer's ``weight`` (float8 [N, K]) and
  ``weight_scale`` (uint8 [N, K/32]) with ``quantization_config`` {"quant_method": "mxgemm", ...}; ``from_pretrained``
  of that folder (this module imported) builds placeholders holding exactly those tensors, loads them, and turns each
  into an ``MXFP8Linear`` prepared once on its device.

Checkpoints written by ``mxgemm quantize`` are compressed-tensors checkpoints: transformers hands them to its own
compressed-tensors quantizer (which dequantizes them to bf16); :func:`mxgemm.load_checkpoint` loads them into
mxgemm's layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..format import BLOCK_SIZE
from ..linear import MXFP8Linear
from ..models import quantizable_linears, quantize_model

__all__ = ["METHOD", "MXFP8Config", "MXFP8HfQuantizer", "enable_transformers"]

METHOD = "mxgemm"


@dataclass
class MXFP8Config(QuantizationConfigMixin):
    """``backend`` / ``recipe`` as for :class:`mxgemm.MXFP8Linear` (None: resolved for the device), ``scale_mode``
    the MX scale rule of online quantization ("floor", "rceil", "compressed-tensors"), ``skip`` the layer names or
    glob patterns left in full precision (as for :func:`mxgemm.quantize_model`)."""

    backend: str | None = None
    recipe: str | None = None
    scale_mode: str = "floor"
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    quant_method: str = METHOD

    def __post_init__(self):
        if self.quant_method != METHOD:
            raise ValueError(f"MXFP8Config is quant_method {METHOD!r}, got {self.quant_method!r}")
        self.skip = list(self.skip)


class _MXWeights(nn.Module):
    """A quantized layer while transformers loads a saved mxgemm model: the checkpoint's tensors as parameters of the
    names, dtypes and shapes it holds, turned into an ``MXFP8Linear`` once they are loaded."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        device = linear.weight.device
        self.weight = nn.Parameter(torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device), requires_grad=False)
        scale = torch.empty(n, k // BLOCK_SIZE, dtype=torch.uint8, device=device)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias


class MXFP8HfQuantizer(HfQuantizer):
    """The transformers quantizer of :class:`MXFP8Config` (see the module docstring)."""

    requires_calibration = False
    quantization_config: MXFP8Config

    def validate_environment(self, *args, **kwargs):
        return None  # mxgemm resolves a backend for any device, or says why a named one cannot run

    def update_dtype(self, dtype):
        return dtype  # fp32, bf16, fp16 models all work

    def _process_model_before_weight_loading(self, model, **kwargs):
        if self.pre_quantized:  # placeholders of the saved tensors' dtypes and shapes, for transformers to load
            for name, module in quantizable_linears(model, self.quantization_config.skip):
                model.set_submodule(name, _MXWeights(module))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        if not self.pre_quantized:
            quantize_model(model, backend=config.backend, scale_mode=config.scale_mode, recipe=config.recipe,
                           skip=config.skip)  # fmt: skip
            return model
        for name, module in list(model.named_modules()):
            if isinstance(module, _MXWeights):
                bias = None if module.bias is None else module.bias.detach()
                layer = MXFP8Linear.from_quantized(module.weight.detach(), module.weight_scale.detach(), bias,
                                                   backend=config.backend, recipe=config.recipe)  # fmt: skip
                model.set_submodule(name, layer)
        return model

    def is_serializable(self, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def enable_transformers() -> None:
    """Register :class:`MXFP8Config` and :class:`MXFP8HfQuantizer` with transformers under ``"mxgemm"`` (done when
    this module is imported; calling it again does nothing)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(METHOD) is not MXFP8Config:
        register_quantization_config(METHOD)(MXFP8Config)
    if AUTO_QUANTIZER_MAPPING.get(METHOD) is not MXFP8HfQuantizer:
        register_quantizer(METHOD)(MXFP8HfQuantizer)


enable_transformers()
