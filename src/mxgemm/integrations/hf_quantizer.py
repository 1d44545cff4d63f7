"""transformers: mxgemm as a quantization method of ``from_pretrained``, through transformers' public registration
(``register_quantization_config`` / ``register_quantizer``, method name ``"mxgemm"``), registered on import.

- Online: ``from_pretrained(bf16_or_fp32_model, quantization_config=MXFP8Config(...))`` loads the weights as they are,
  then replaces each ``nn.Linear`` (but the skipped ones) by an ``MXFP8Linear`` quantized from them, layer by layer
  (:func:`mxgemm.quantize_model`). fp32, bf16 and fp16 models work: the layers run in bf16/fp16 and answer in the
  activations' dtype. ``MXFP8Config(experts=True)`` also replaces the 3-D experts of mixture-of-experts layers by
  ``MXFP8Experts`` (as :func:`mxgemm.quantize_model` does); ``save_pretrained`` refuses such a model (saving quantized
  experts through transformers is not built yet: :func:`mxgemm.save_checkpoint` writes them per expert).
- Saved and loaded back: ``save_pretrained`` writes each quantized layer's ``weight`` (its float8 [N, K] bytes as
  int32 [N, K/4]: transformers without this module imported refuses that shape, where it would read float8 [N, K]
  as bf16 values) and ``weight_scale`` (uint8 [N, K/32]) with ``quantization_config`` {"quant_method": "mxgemm",
  ...}; ``from_pretrained`` of that folder (this module imported) checks those tensors in its files, builds
  placeholders holding exactly them (float8 [N, K] weights of earlier saves too), loads them, and turns each into an
  ``MXFP8Linear`` prepared once on its device. Both ways, layers that read the same input then run as one
  and gated MLPs hand ``down_proj`` their product quantized in one kernel (:func:`mxgemm.fusion.fuse`).

- MXFP8 checkpoints of other producers (compressed-tensors, as ``mxgemm quantize`` writes them, and NVIDIA ModelOpt):
  their config names another method, which transformers would dequantize to bf16. ``from_pretrained(path,
  config=checkpoint_config(path))`` loads them into ``MXFP8Linear`` layers instead: the config is the checkpoint's
  own with mxgemm as its quantization method, naming the layers whose scales the checkpoint holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..checkpoints import CheckpointError, TensorSource, check_pair, check_values
from ..errors import MXGemmError
from ..format import BLOCK_SIZE, e8m0_bytes
from ..fusion import fuse
from ..linear import MXFP8Linear
from ..models import quantizable_linears, quantize_model
from ..moe import MXFP8Experts
from ..resolve import check_request

__all__ = ["METHOD", "MXFP8Config", "MXFP8HfQuantizer", "checkpoint_config", "enable_transformers"]

METHOD = "mxgemm"


@dataclass
class MXFP8Config(QuantizationConfigMixin):
    """``backend`` / ``recipe`` as for :class:`mxgemm.MXFP8Linear` (None: resolved for the device), ``scale_mode``
    the MX scale rule of online quantization ("floor", "rceil", "compressed-tensors"), ``skip`` the layer names or
    glob patterns left in full precision (as for :func:`mxgemm.quantize_model`), ``experts`` whether online
    quantization takes the experts of mixture-of-experts layers too (a model so quantized cannot be saved through
    transformers yet). For a saved checkpoint, ``modules``
    names its quantized layers (None: every linear layer but ``skip``) and ``scale_dtype`` the dtype its scales are
    stored in ("uint8" or "float8_e8m0fnu")."""

    backend: str | None = None
    recipe: str | None = None
    scale_mode: str = "floor"
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    experts: bool = False
    modules: list[str] | None = None
    scale_dtype: str = "uint8"
    quant_method: str = METHOD

    def __post_init__(self):
        if self.quant_method != METHOD:
            raise ValueError(f"MXFP8Config is quant_method {METHOD!r}, got {self.quant_method!r}")
        if self.scale_dtype not in _SCALE_DTYPES:
            raise ValueError(f"scale_dtype must be one of {sorted(_SCALE_DTYPES)}, got {self.scale_dtype!r}")
        check_request(self.backend, self.recipe, self.scale_mode)
        self.skip = [self.skip] if isinstance(self.skip, str) else list(self.skip)  # "lm_head" is one pattern
        names = self.skip + list(self.modules or [])
        if not all(isinstance(n, str) for n in names) or not isinstance(self.experts, bool):
            raise TypeError("MXFP8Config: skip and modules are lists of layer names or patterns, experts True/False")


_SCALE_DTYPES = {"uint8": torch.uint8, "float8_e8m0fnu": torch.float8_e8m0fnu}


class _MXWeights(nn.Module):
    """A quantized layer while transformers loads a saved mxgemm model: the checkpoint's tensors as parameters of the
    names, dtypes and shapes it holds (``packed``: the weight's float8 bytes as int32 [N, K/4]), turned into an
    ``MXFP8Linear`` once they are loaded."""

    def __init__(self, linear: nn.Linear, scale_dtype: torch.dtype, packed: bool):
        super().__init__()
        n, k = linear.out_features, linear.in_features
        device = linear.weight.device
        shape, dtype = ((n, k // 4), torch.int32) if packed else ((n, k), torch.float8_e4m3fn)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        scale = torch.empty(n, k // BLOCK_SIZE, dtype=scale_dtype, device=device)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias

    def checked(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The loaded (weight, scale), or :class:`mxgemm.CheckpointError` naming the layer where they do not
        dequantize to finite values (the values check of :func:`mxgemm.load_checkpoint`)."""
        weight, scale = self.weight.detach().view(torch.float8_e4m3fn), e8m0_bytes(self.weight_scale.detach())
        check_values(name, weight, scale)
        return weight, scale


def _check_saved(
    files: list[str] | None, layers: list[tuple[str, nn.Linear]], scale_dtype: torch.dtype
) -> dict[str, bool]:
    """Before transformers loads a saved mxgemm model: each quantized layer's pair in the safetensors files is there,
    of MXFP8's dtypes and the layer's shapes, and its scales of the dtype the config records (transformers would
    leave a missing tensor uninitialised and cast one of another dtype by value); :class:`mxgemm.CheckpointError`
    naming the tensor, as :func:`mxgemm.load_checkpoint` refuses it. Answers which layers' weights are packed as
    int32 [N, K/4] (saves since they are; float8 [N, K] before)."""
    if not files:
        raise CheckpointError("a saved mxgemm model loads from its safetensors files (from_pretrained gave none)")
    source = TensorSource(Path(files[0]).parent)
    packed = {}
    for name, module in layers:
        weight = f"{name}.weight"
        n, k = module.out_features, module.in_features
        packed[name] = source.dtypes.get(weight) == torch.int32 and source.shapes[weight] == (n, k // 4)
        if packed[name]:  # read as the float8 [N, K] it holds
            source.dtypes[weight], source.shapes[weight] = torch.float8_e4m3fn, (n, k)
        check_pair(name, source, module)
        stored = source.dtypes[f"{name}.weight_scale"]
        if stored != scale_dtype:
            raise CheckpointError(
                f"{name}.weight_scale has dtype {stored}; the config records scales as {scale_dtype} (scale_dtype)"
            )
    return packed


class MXFP8HfQuantizer(HfQuantizer):
    """The transformers quantizer of :class:`MXFP8Config` (see the module docstring)."""

    requires_calibration = False
    quantization_config: MXFP8Config

    def validate_environment(self, *args, **kwargs):
        return None  # mxgemm resolves a backend for any device, or says why a named one cannot run

    def update_dtype(self, dtype):
        return dtype  # fp32, bf16, fp16 models all work

    def _process_model_before_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        if self.pre_quantized:  # placeholders of the saved tensors' dtypes and shapes, for transformers to load
            if config.modules is None:
                layers = quantizable_linears(model, config.skip)
            else:
                linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
                wrong = [name for name in config.modules if name not in linears]
                if wrong:
                    raise ValueError(f"the checkpoint quantizes {wrong[0]}, which is not an nn.Linear of this model")
                layers = [(name, linears[name]) for name in config.modules]
            scale_dtype = _SCALE_DTYPES[config.scale_dtype]
            packed = _check_saved(kwargs.get("checkpoint_files"), layers, scale_dtype)
            for name, module in layers:
                model.set_submodule(name, _MXWeights(module, scale_dtype, packed[name]))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        if not self.pre_quantized:
            options = {"backend": config.backend, "scale_mode": config.scale_mode, "recipe": config.recipe}
            quantize_model(model, skip=config.skip, experts=config.experts, **options)
            return model
        loaded = {name: module for name, module in model.named_modules() if isinstance(module, _MXWeights)}
        checked = {name: module.checked(name) for name, module in loaded.items()}  # all, before the model changes
        for name, module in loaded.items():
            bias = None if module.bias is None else module.bias.detach()
            layer = MXFP8Linear.from_quantized(*checked[name], bias, backend=config.backend, recipe=config.recipe)
            model.set_submodule(name, layer)
        fuse(model)
        return model

    def get_state_dict_and_metadata(self, model):
        """What ``save_pretrained`` writes: the model's state dict with each quantized layer's float8 [N, K] weight
        as its bytes in int32 [N, K/4] (the module docstring says why)."""
        experts = [name for name, module in model.named_modules() if isinstance(module, MXFP8Experts)]
        if experts:
            raise MXGemmError(
                f"{experts[0]} holds quantized experts, which save_pretrained does not write yet: "
                "mxgemm.save_checkpoint(model, folder) writes them per expert (compressed-tensors), or quantize with "
                "MXFP8Config(experts=False)"
            )
        state = model.state_dict()
        for name, module in model.named_modules():
            if isinstance(module, MXFP8Linear):
                key = f"{name}.weight" if name else "weight"
                state[key] = state[key].contiguous().view(torch.int32)
        return state, {}

    def is_serializable(self, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def checkpoint_config(
    path: str | Path, *, backend: str | None = None, recipe: str | None = None, **config_kwargs
) -> PretrainedConfig:
    """The config of the MXFP8 checkpoint folder ``path`` (compressed-tensors or ModelOpt) with mxgemm as its
    quantization method: ``from_pretrained(path, config=checkpoint_config(path))`` loads every layer whose scales the
    checkpoint holds into an ``MXFP8Linear`` (``backend`` / ``recipe`` as for it) and the rest as transformers does.
    ``config_kwargs`` go to ``AutoConfig.from_pretrained``. :class:`mxgemm.CheckpointError` if the folder is not an
    MXFP8 checkpoint."""
    from transformers import AutoConfig

    from ..checkpoints import read_format

    read_format(path)
    source = TensorSource(path)
    modules = sorted(key.removesuffix(".weight_scale") for key in source.where if key.endswith(".weight_scale"))
    experts = [m for m in modules if re.search(r"\.experts\.\d+\.", m)]
    if experts:
        raise CheckpointError(
            f"{path} quantizes the experts of a mixture of experts ({experts[0]}, ...), which this route does not "
            "load yet: build the model and call mxgemm.load_checkpoint(model, path)"
        )
    dtypes = {str(source.dtypes[f"{m}.weight_scale"]).removeprefix("torch.") for m in modules}
    if len(dtypes) > 1 or not dtypes <= set(_SCALE_DTYPES):
        raise CheckpointError(f"{path}: weight scales stored as {sorted(dtypes)}; one of {sorted(_SCALE_DTYPES)}")
    config = AutoConfig.from_pretrained(path, **config_kwargs)
    mx = MXFP8Config(backend=backend, recipe=recipe, modules=modules, scale_dtype=dtypes.pop() if dtypes else "uint8")
    config.quantization_config = mx.to_dict()
    return config


def enable_transformers() -> None:
    """Register :class:`MXFP8Config` and :class:`MXFP8HfQuantizer` with transformers under ``"mxgemm"`` (done when
    this module is imported; calling it again does nothing)."""
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(METHOD) is not MXFP8Config:
        register_quantization_config(METHOD)(MXFP8Config)
    if AUTO_QUANTIZER_MAPPING.get(METHOD) is not MXFP8HfQuantizer:
        register_quantizer(METHOD)(MXFP8HfQuantizer)


enable_transformers()
