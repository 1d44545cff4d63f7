"""mxgemm inside the stacks users already run. Each integration imports its framework only when one of its names is
first used (``import mxgemm`` imports none of them):

- ``MXFP8Config`` (transformers): ``AutoModelForCausalLM.from_pretrained(path, quantization_config=MXFP8Config())``
  quantizes a bf16/fp16/fp32 model online into ``MXFP8Linear`` layers; a model saved from there with
  ``save_pretrained`` loads back into them. Registered with transformers' ``register_quantization_config`` /
  ``register_quantizer`` under the method name ``"mxgemm"`` when first used (:func:`enable_transformers`).
  ``from_pretrained(path, config=checkpoint_config(path))`` loads an MXFP8 checkpoint of another producer
  (compressed-tensors, ModelOpt) into them.
- ``MXFP8LinearConfig`` (torchao): ``torchao.quantization.quantize_(model, MXFP8LinearConfig())`` swaps
  ``nn.Linear`` layers for ``MXFP8Linear`` through ``register_quantize_module_handler``; with
  ``filter_fn=moe_filter(model)`` also the experts of mixtures of experts for ``MXFP8Experts``, routers kept.
"""

from __future__ import annotations

import importlib

__all__ = [
    "MXFP8Config",
    "MXFP8HfQuantizer",
    "MXFP8LinearConfig",
    "checkpoint_config",
    "enable_transformers",
    "moe_filter",
]

_HOMES = {
    "MXFP8Config": "hf_quantizer",
    "MXFP8HfQuantizer": "hf_quantizer",
    "enable_transformers": "hf_quantizer",
    "checkpoint_config": "hf_quantizer",
    "MXFP8LinearConfig": "torchao_config",
    "moe_filter": "torchao_config",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
