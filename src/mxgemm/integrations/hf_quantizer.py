"""transformers: mxgemm as a quantization method of ``from_pretrained``, through transformers' public registration
(``register_quantization_config`` / ``register_quantizer``, method name ``"mxgemm"``), registered on import.

- Online: ``from_pretrained(bf16_or_fp32_model, quantization_config=MXFP8Config(...))`` loads the weights as they are,
  then replaces each ``nn.Linear`` (but the skipped ones) by an ``MXFP8Linear`` quantized from them, layer by layer
  (:func:`mxgemm.quantize_model`). fp32, bf16 and fp16 models work: the layers run in bf16/fp16 and answer in the
  activations' dtype. ``MXFP8Config(experts=True)`` also replaces the 3-D experts of mixture-of-experts layers by
  ``MXFP8Experts`` (as :func:`mxgemm.quantize_model` does).
- Saved and loaded back: ``save_pretrained`` writes each quantized layer's ``weight`` (its float8 [N, K] bytes as
  int32 [N, K/4]: transformers without this module imported refuses that shape, where it would read float8 [N, K]
  as bf16 values) and ``weight_scale`` (uint8 [N, K/32]) with ``quantization_config`` {"quant_method": "mxgemm",
  ...}, and quantized experts per expert under the names transformers stores the model's experts under
  (``<experts>.<e>.{gate,up,down}_proj.weight``, Mixtral's ``w1`` / ``w3`` / ``w2``) with ``weight_scale`` beside
  each, the weights packed alike); ``from_pretrained`` of that folder (this module imported) checks those
  tensors in its files, builds placeholders holding exactly them (float8 [N, K] weights of earlier saves too), loads
  them (transformers' own converters stack each experts module's per-expert tensors, and a copy of each for the
  ``_scale`` tensors beside them), and turns each into an ``MXFP8Linear`` or ``MXFP8Experts`` prepared once on its
  device. Both ways, layers that read the same input then run as one and gated MLPs hand ``down_proj`` their
  product quantized in one kernel (:func:`mxgemm.fusion.fuse`).

- MXFP8 checkpoints of other producers (compressed-tensors, as ``mxgemm quantize`` writes them, and NVIDIA ModelOpt):
  their config names another method, which transformers would dequantize to bf16. ``from_pretrained(path,
  config=checkpoint_config(path))`` loads them into ``MXFP8Linear`` layers instead: the config is the checkpoint's
  own with mxgemm as its quantization method, naming the layers whose scales the checkpoint holds; quantized experts
  stored per expert load into ``MXFP8Experts``.
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

from ..checkpoints import (
    CheckpointError,
    TensorSource,
    check_pair,
    check_values,
    experts_in,
    per_expert_state,
    stored_expert_names,
    stored_layer_names,
)
from ..errors import MXGemmError
from ..format import BLOCK_SIZE, e8m0_bytes
from ..fusion import fuse
from ..linear import MXFP8Linear
from ..models import quantizable_linears, quantize_model
from ..moe import MXFP8Experts, experts_modules, experts_unfit_reason, per_expert_shapes
from ..resolve import check_request

__all__ = ["METHOD", "MXFP8Config", "MXFP8HfQuantizer", "checkpoint_config", "enable_transformers"]

METHOD = "mxgemm"


@dataclass
class MXFP8Config(QuantizationConfigMixin):
    """``backend`` / ``recipe`` as for :class:`mxgemm.MXFP8Linear` (None: resolved for the device), ``scale_mode``
    the MX scale rule of online quantization ("floor", "rceil", "compressed-tensors"), ``skip`` the layer names or
    glob patterns left in full precision (as for :func:`mxgemm.quantize_model`), ``experts`` whether online
    quantization takes the experts of mixture-of-experts layers too. For a saved checkpoint, ``modules`` names its
    quantized linear layers (None: every linear layer but ``skip``), ``scale_dtype`` the dtype its scales are stored
    in ("uint8" or "float8_e8m0fnu"); its experts are quantized where it stores their scales."""

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


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # a tensor of one expert, as checkpoints store them
_SCALE_DTYPES = {"uint8": torch.uint8, "float8_e8m0fnu": torch.float8_e8m0fnu}


class _MXWeights(nn.Module):
    """A quantized layer while transformers loads a saved mxgemm model: the checkpoint's tensors as parameters of the
    names, dtypes and shapes it holds (``packed``: the weight's float8 bytes as int32 [N, K/4]), turned into an
    ``MXFP8Linear`` once they are loaded."""

    def __init__(self, linear: nn.Linear, scale_dtype: torch.dtype, packed: bool):
        super().__init__()
        self.weight, self.weight_scale = _placeholders(
            (linear.out_features, linear.in_features), scale_dtype, packed, linear.weight.device
        )
        self.bias = linear.bias

    def checked(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The loaded (weight, scale), or :class:`mxgemm.CheckpointError` naming the layer where they do not
        dequantize to finite values (the values check of :func:`mxgemm.load_checkpoint`)."""
        weight, scale = self.weight.detach().view(torch.float8_e4m3fn), e8m0_bytes(self.weight_scale.detach())
        check_values(name, weight, scale)
        return weight, scale


class _MXExpertsWeights(nn.Module):
    """An experts module while transformers loads its MXFP8 experts: ``gate_up_proj`` [E, 2I, H] and ``down_proj``
    [E, H, I] of the stored weights' dtype (``packed``: their float8 bytes as int32, the last dimension a quarter) and
    their ``_scale`` tensors [E, N, K/32], which transformers' converters stack from the per-expert tensors; turned
    into an ``MXFP8Experts`` once they are loaded."""

    def __init__(self, module: nn.Module, scale_dtype: torch.dtype, packed: bool):
        super().__init__()
        (experts, _, _), device = module.gate_up_proj.shape, module.gate_up_proj.device
        width, hidden = per_expert_shapes(module)["gate_proj"]
        self.gate_up_proj, self.gate_up_proj_scale = _placeholders(
            (experts, 2 * width, hidden), scale_dtype, packed, device
        )
        self.down_proj, self.down_proj_scale = _placeholders((experts, hidden, width), scale_dtype, packed, device)

    def checked(self, name: str) -> list[torch.Tensor]:
        """The loaded (gate_up, its scale, down, its scale), or :class:`mxgemm.CheckpointError` naming the experts
        module and projection where they do not dequantize to finite values."""
        tensors = []
        for projection in ("gate_up_proj", "down_proj"):
            weight = getattr(self, projection).detach().view(torch.float8_e4m3fn)
            scale = e8m0_bytes(getattr(self, f"{projection}_scale").detach())
            check_values(f"{name}.{projection}", weight, scale)
            tensors += [weight, scale]
        return tensors


def _placeholders(
    shape: tuple[int, ...], scale_dtype: torch.dtype, packed: bool, device: torch.device
) -> tuple[nn.Parameter, nn.Parameter]:
    """Empty (weight, scale) parameters for an MX weight of ``shape`` [..., N, K] as stored: the weight float8, or
    (``packed``) its bytes as int32 [..., N, K/4]; the scale [..., N, K/32] of ``scale_dtype``."""
    *rows, k = shape
    weight = ((*rows, k // 4), torch.int32) if packed else (shape, torch.float8_e4m3fn)
    pairs = (weight, ((*rows, k // BLOCK_SIZE), scale_dtype))
    return tuple(nn.Parameter(torch.empty(s, dtype=d, device=device), requires_grad=False) for s, d in pairs)


def _unpack_header(source: TensorSource, weight: str, n: int, k: int) -> bool:
    """Whether ``weight`` is stored packed (float8 [N, K] bytes as int32 [N, K/4], as saves since then are); if so,
    its header is read as the float8 [N, K] it holds."""
    packed = source.dtypes.get(weight) == torch.int32 and source.shapes[weight] == (n, k // 4)
    if packed:
        source.dtypes[weight], source.shapes[weight] = torch.float8_e4m3fn, (n, k)
    return packed


def _check_scale_dtype(source: TensorSource, scale: str, scale_dtype: torch.dtype) -> None:
    stored = source.dtypes[scale]
    if stored != scale_dtype:
        raise CheckpointError(f"{scale} has dtype {stored}; the config records scales as {scale_dtype} (scale_dtype)")


def _refuse_scales_read_under_other_names(source: TensorSource) -> None:
    """transformers loads tensors by their stored names: scales stored as ``weight_scale_inv`` would leave the
    layers' ``weight_scale`` unloaded, so such a checkpoint is refused, naming the route that reads it."""
    if source.stored:
        first = next(iter(source.stored.values()))
        raise CheckpointError(
            f"{first}: scales stored as weight_scale_inv (SGLang-style), which the transformers route does not read; "
            "build the model and call mxgemm.load_checkpoint(model, path), which does"
        )


def _check_saved(
    files: list[str] | None,
    model: nn.Module,
    layers: list[tuple[str, nn.Linear]],
    scale_dtype: torch.dtype,
    stored: dict[str, dict[str, list[str]]],
    stored_as: dict[str, str],
) -> tuple[dict[str, bool], dict[str, bool]]:
    """Before transformers loads a saved mxgemm model: each quantized layer's pair in the safetensors files is there,
    of MXFP8's dtypes and the layer's shapes, and its scales of the dtype the config records (transformers would
    leave a missing tensor uninitialised and cast one of another dtype by value); so are the per-expert pairs of
    every experts module the files store quantized (:func:`mxgemm.checkpoints.experts_in`);
    :class:`mxgemm.CheckpointError` naming the tensor, as :func:`mxgemm.load_checkpoint` refuses it. Answers, for
    the quantized layers and then the quantized experts modules, whether their weights are packed as int32 [N, K/4]
    (saves since they are; float8 [N, K] before). ``stored``: :func:`_stored_names`; ``stored_as``: the layers'
    names in the files (:func:`mxgemm.checkpoints.stored_layer_names`)."""
    if not files:
        raise CheckpointError("a saved mxgemm model loads from its safetensors files (from_pretrained gave none)")
    source = TensorSource(Path(files[0]).parent)
    _refuse_scales_read_under_other_names(source)
    packed = {}
    for name, module in layers:
        at = stored_as.get(name, name)  # the layer's name in the files (transformers' renamings reverted)
        packed[name] = _unpack_header(source, f"{at}.weight", module.out_features, module.in_features)
        check_pair(at, source, module)
        _check_scale_dtype(source, f"{at}.weight_scale", scale_dtype)
    experts_packed = {}
    for name, module in experts_modules(model):
        if name not in stored or module.gate_up_proj.dim() != 3:
            continue
        shapes = per_expert_shapes(module)
        packed_now = {_unpack_header(source, n, *shapes[p]) for p, ns in stored[name].items() for n in ns}
        experts_packed[name] = packed_now == {True}
    quantized, consumed, _ = experts_in(model, source, stored)
    for name in quantized:
        reason = experts_unfit_reason(model.get_submodule(name))
        if reason:
            raise CheckpointError(
                f"{name} holds MXFP8 experts that MXFP8Experts cannot take: {reason}; mxgemm.load_checkpoint loads "
                "them dequantized into the model's own experts"
            )
    for names in quantized.values():
        for weight in (n for ns in names.values() for n in ns):
            _check_scale_dtype(source, f"{weight}_scale", scale_dtype)
    unread = [k for k in source.where if _PER_EXPERT.search(k) and k.endswith(".weight_scale") and k not in consumed]
    if unread:  # transformers would load their float8 weights into the model's bf16 experts by value
        raise CheckpointError(
            f"{unread[0]} is a quantized expert this route does not read: it loads experts stored beside their "
            "weight_scale under the names transformers stores this model's experts under"
        )
    return packed, {name: experts_packed[name] for name in quantized}


def _stored_names(model: nn.Module, *, quantized: bool = False) -> dict[str, dict[str, list[str]]]:
    """:func:`mxgemm.checkpoints.stored_expert_names`; for a quantized experts module whose experts transformers
    would not store one tensor per expert and projection, :class:`mxgemm.MXGemmError` naming it, since
    save_pretrained could not write it."""
    names = stored_expert_names(model, quantized=quantized)
    for name, module in model.named_modules():
        if quantized and isinstance(module, MXFP8Experts) and name not in names:
            raise MXGemmError(
                f"{name}: transformers does not store {type(model).__name__}'s experts one tensor per expert and "
                "projection: save_pretrained cannot write them quantized; mxgemm.save_checkpoint(model, folder) "
                "does, or quantize with MXFP8Config(experts=False)"
            )
    return names


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
            stored = _stored_names(model)
            stored_as = stored_layer_names(model, stored)  # transformers' renamings reverted
            if config.modules is None:
                layers = quantizable_linears(model, config.skip)
            else:
                linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
                own = {s: m for m, s in stored_as.items()}
                modules = [own.get(name, name) for name in config.modules]  # as the files name them -> the model's
                wrong = [stored for stored, name in zip(config.modules, modules, strict=True) if name not in linears]
                if wrong:
                    raise ValueError(f"the checkpoint quantizes {wrong[0]}, which is not an nn.Linear of this model")
                layers = [(name, linears[name]) for name in modules]
            scale_dtype = _SCALE_DTYPES[config.scale_dtype]
            files = kwargs.get("checkpoint_files")
            packed, experts = _check_saved(files, model, layers, scale_dtype, stored, stored_as)
            for name, module in layers:
                model.set_submodule(name, _MXWeights(module, scale_dtype, packed[name]))
            for name, experts_packed in experts.items():
                model.set_submodule(name, _MXExpertsWeights(model.get_submodule(name), scale_dtype, experts_packed))
        return model

    def update_weight_conversions(self, weight_conversions, model=None):
        """transformers' converters stack per-expert ``weight`` tensors into an experts module's 3-D tensors
        (``experts.*.gate_proj.weight`` + ``up_proj`` -> ``gate_up_proj``); each such converter gets a copy for the
        ``weight_scale`` tensors beside them (-> ``gate_up_proj_scale``), with the same operations. (transformers
        5.0-5.17 call this with the conversions only, later ones with the model too.)"""
        from transformers.core_model_loading import WeightConverter

        updated = []
        for converter in weight_conversions:
            updated.append(converter)
            sources = getattr(converter, "_original_source_patterns", [])
            if isinstance(converter, WeightConverter) and sources and all(p.endswith(".weight") for p in sources):
                targets = converter._original_target_patterns
                scales = WeightConverter(
                    [f"{p}_scale" for p in sources], [f"{t}_scale" for t in targets], list(converter.operations)
                )
                for attr in ("scope_prefix", "base_model_prefix", "force_cpu"):
                    if hasattr(converter, attr):
                        setattr(scales, attr, getattr(converter, attr))
                updated.append(scales)
        return updated + self.get_weight_conversions()

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config
        if not self.pre_quantized:
            options = {"backend": config.backend, "scale_mode": config.scale_mode, "recipe": config.recipe}
            quantize_model(model, skip=config.skip, experts=config.experts, **options)
            return model
        loaded = {
            name: module
            for name, module in model.named_modules()
            if isinstance(module, (_MXWeights, _MXExpertsWeights))
        }
        checked = {name: module.checked(name) for name, module in loaded.items()}  # all, before the model changes
        options = {"backend": config.backend, "recipe": config.recipe}
        for name, module in loaded.items():
            if isinstance(module, _MXExpertsWeights):
                model.set_submodule(name, MXFP8Experts.from_quantized(*checked[name], **options))
                continue
            bias = None if module.bias is None else module.bias.detach()
            model.set_submodule(name, MXFP8Linear.from_quantized(*checked[name], bias, **options))
        fuse(model)
        return model

    def get_state_dict_and_metadata(self, model):
        """What ``save_pretrained`` writes: the model's state dict with quantized experts per expert and each
        quantized float8 [N, K] weight as its bytes in int32 [N, K/4] (the module docstring says why)."""
        stored = _stored_names(model, quantized=True)
        state = per_expert_state(model, model.state_dict(), stored)
        weights = [f"{name}.weight".lstrip(".") for name, m in model.named_modules() if isinstance(m, MXFP8Linear)]
        weights += [n for names in stored.values() for ns in names.values() for n in ns]
        for key in weights:
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
    checkpoint holds into an ``MXFP8Linear`` (``backend`` / ``recipe`` as for it), experts it stores quantized per
    expert into ``MXFP8Experts``, and the rest as transformers does.
    ``config_kwargs`` go to ``AutoConfig.from_pretrained``. :class:`mxgemm.CheckpointError` if the folder is not an
    MXFP8 checkpoint."""
    from transformers import AutoConfig

    from ..checkpoints import read_format

    read_format(path)
    source = TensorSource(path)
    _refuse_scales_read_under_other_names(source)
    scaled = sorted(key.removesuffix(".weight_scale") for key in source.where if key.endswith(".weight_scale"))
    modules = [m for m in scaled if not _PER_EXPERT.search(m)]  # experts: where their scales are
    dtypes = {str(source.dtypes[f"{m}.weight_scale"]).removeprefix("torch.") for m in scaled}
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
