"""MXFP8 checkpoints in safetensors: compressed-tensors ``mxfp8-quantized`` and NVIDIA ModelOpt ``quant_algo: MXFP8``.

Both store, for each quantized linear layer ``<name>``, ``<name>.weight`` float8_e4m3fn [N, K] and
``<name>.weight_scale`` uint8 E8M0 [N, K/32], row-major and unswizzled; every other tensor is stored as is.
compressed-tensors describes the scheme in ``config.json`` (``quantization_config``: ``MXFP8`` = dynamic MX
activations, ``MXFP8A16`` = weight-only); ModelOpt in ``hf_quant_config.json`` (or ``config.json`` with
``quant_method: modelopt``). The activation scheme a checkpoint names is reported, not enforced: the backend (and so
the recipe) is mxgemm's choice for the device, or yours (``backend=``, ``recipe=``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .errors import MXGemmError
from .format import BLOCK_SIZE, MXFP8, SCALE_DTYPES, MXTensor, dequantize, e8m0_bytes, nonfinite_reason
from .fusion import fuse as fuse_model
from .fusion import tally
from .linear import MXFP8Linear
from .model_folder import ModelFolderError, folder_file, read_folder_file
from .moe import (
    PROJECTIONS,
    MXFP8Experts,
    experts_layout_reason,
    experts_modules,
    experts_stay_in_bf16,
    experts_unfit_reason,
    is_experts_module,
    per_expert_names,
    per_expert_shapes,
)

__all__ = [
    "SCHEMES",
    "CheckpointError",
    "CheckpointFormat",
    "TensorSource",
    "check_pair",
    "check_values",
    "experts_in",
    "load_checkpoint",
    "per_expert_state",
    "read_format",
    "save_checkpoint",
    "source_files",
    "stored_expert_names",
    "stored_layer_names",
    "stored_module_names",
    "stored_to_model_names",
]


class CheckpointError(MXGemmError, ValueError):
    """A checkpoint that is not an MXFP8 checkpoint mxgemm can load, with the tensor or file at fault."""


INDEX = "model.safetensors.index.json"
MAX_JSON_BYTES = 256 << 20  # a config or index: an index of a million tensors is about 100 MB


def _mx_args(dynamic: bool) -> dict:
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": MXFP8.block_size,
        "strategy": "group",
        "dynamic": dynamic,
        "scale_dtype": "torch.uint8",
    }


# compressed-tensors presets (quant_scheme.py): MX weights, and dynamic MX activations for MXFP8
SCHEMES: dict[str, dict] = {
    "MXFP8": {"weights": _mx_args(False), "input_activations": _mx_args(True)},
    "MXFP8A16": {"weights": _mx_args(False), "input_activations": None},
}


def compressed_tensors_config(scheme: str, ignore: Sequence[str]) -> dict:
    """The ``quantization_config`` entry of ``config.json`` for an MXFP8 compressed-tensors checkpoint."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    group = {"targets": ["Linear"], **SCHEMES[scheme], "output_activations": None, "format": None}
    return {
        "quant_method": "compressed-tensors",
        "format": MXFP8.compressed_tensors,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


@dataclass(frozen=True)
class CheckpointFormat:
    kind: str  # "compressed-tensors", "modelopt" or "fp8" (block-FP8 configs of 1x32 blocks, SGLang-style)
    scheme: str  # "MXFP8" (dynamic MX activations), "MXFP8A16" (weight-only), or "MXFP8" for ModelOpt and fp8
    ignore: tuple[str, ...]  # module names or patterns left unquantized


def read_format(path: str | Path) -> CheckpointFormat:
    """Which MXFP8 format the checkpoint folder declares; :class:`CheckpointError` if none."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    config = _read_json(path / "config.json") if (path / "config.json").exists() else {}
    qc = _object(config.get("quantization_config") or config.get("compression_config") or {}, path / "config.json")
    if (path / "hf_quant_config.json").exists():
        where = path / "hf_quant_config.json"
        return _modelopt_format(_object(_read_json(where).get("quantization", {}), where), where)
    if qc.get("quant_method") == "modelopt":
        return _modelopt_format(qc, path / "config.json")
    if qc.get("quant_method") == "fp8":  # DeepSeek-V3-style block-FP8 configs, MX when the blocks are 1x32
        where = path / "config.json"
        if qc.get("weight_block_size") != [1, MXFP8.block_size]:
            raise CheckpointError(
                f"{where}: fp8 weight_block_size {qc.get('weight_block_size')!r} is not MXFP8's [1, {MXFP8.block_size}]"
            )
        return CheckpointFormat("fp8", "MXFP8", _names(qc.get("modules_to_not_convert"), where, "ignore"))
    if qc.get("quant_method") == "compressed-tensors":
        where = path / "config.json"
        if qc.get("format") != MXFP8.compressed_tensors:
            raise CheckpointError(
                f"{where}: compressed-tensors format {qc.get('format')!r} is not {MXFP8.compressed_tensors}"
            )
        groups = list(_object(qc.get("config_groups") or {}, where).values())
        if not groups:
            raise CheckpointError(f"{where}: quantization_config has no config_groups")
        acts = _object(_object(groups[0], where).get("input_activations") or {}, where)
        scheme = "MXFP8" if acts.get("dynamic") and acts.get("group_size") == MXFP8.block_size else "MXFP8A16"
        return CheckpointFormat("compressed-tensors", scheme, _names(qc.get("ignore"), where, "ignore"))
    raise CheckpointError(
        f"{path}: no MXFP8 quantization config (config.json quantization_config or hf_quant_config.json)"
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(read_folder_file(path, MAX_JSON_BYTES))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not UTF-8 or not JSON
        raise CheckpointError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not a JSON object")
    return data


def _modelopt_format(q: dict, where: Path) -> CheckpointFormat:
    if q.get("quant_algo") != MXFP8.modelopt:
        raise CheckpointError(f"{where}: ModelOpt quant_algo {q.get('quant_algo')!r} is not {MXFP8.modelopt}")
    return CheckpointFormat("modelopt", "MXFP8", _names(q.get("exclude_modules"), where, "exclude_modules"))


def _object(value, where: Path) -> dict:
    """``value`` where it is a JSON object, else :class:`CheckpointError` naming the file."""
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a JSON object in the quantization config, found {value!r:.60}")
    return value


def _names(value, where: Path, key: str) -> tuple[str, ...]:
    """A list of module names (or patterns) from a quantization config, else :class:`CheckpointError`."""
    if value is None:
        return ()
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise CheckpointError(f"{where}: {key} must be a list of module names, found {value!r:.60}")
    return tuple(value)


def source_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint or model folder, in its index's order where it has one."""
    folder = Path(folder)
    index = folder / INDEX
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map object naming its shards)")
        names = [_checked(folder_file, folder, f).name for f in weight_map.values()]  # each a file name: hashable
        return [folder / f for f in dict.fromkeys(names)]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors files")
    return [_checked(folder_file, folder, f.name) for f in files]


def _checked(check, *args):
    try:
        return check(*args)
    except ModelFolderError as exc:
        raise CheckpointError(str(exc)) from None


_ST_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U8": torch.uint8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "BOOL": torch.bool,
}
if hasattr(torch, "float8_e8m0fnu"):
    _ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


class TensorSource:
    """The tensors of a folder's safetensors files, read lazily: names, shapes and dtypes from the files' headers
    at once (a tensor in two files and unreadable files refused, naming them), each tensor's data when loaded.

    A float8 weight's ``weight_scale_inv`` (SGLang-style files; the factor its elements are multiplied by, despite
    the name) is read as its ``weight_scale``: E8M0 bytes as they are, float32 powers of two as their E8M0 bytes
    (anything else refused when loaded, naming it)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype | None] = {}
        for f in source_files(folder):
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as exc:  # safetensors' own error (truncated file, bad header, ...) names no file
                raise CheckpointError(f"{f}: not a readable safetensors file ({str(exc).splitlines()[0]})") from None
            with handle:
                for name in handle.keys():
                    if name in self.where:
                        raise CheckpointError(f"{name} is in two files, {self.where[name].name} and {f.name}")
                    info = handle.get_slice(name)
                    self.where[name] = f
                    self.shapes[name] = tuple(info.get_shape())
                    self.dtypes[name] = _ST_DTYPES.get(info.get_dtype())
        self.stored: dict[str, str] = {}  # a name read under another: weight_scale -> weight_scale_inv
        self.renamed: dict[str, str] = {}  # a model's name -> the name stored (:meth:`rename`)
        for name in [n for n in self.where if n.endswith(".weight_scale_inv")]:
            scale = name.removesuffix("_inv")
            if scale in self.where or self.dtypes.get(scale.removesuffix("_scale")) != torch.float8_e4m3fn:
                continue
            self.stored[scale] = name
            self.where[scale], self.shapes[scale] = self.where.pop(name), self.shapes.pop(name)
            dtype = self.dtypes.pop(name)
            self.dtypes[scale] = torch.uint8 if dtype == torch.float32 else dtype

    def rename(self, names: dict[str, str]) -> None:
        """Read each stored name of ``names`` (and its ``_scale`` beside it) under the name it maps to: a model's own
        names for a checkpoint stored under others (:func:`stored_to_model_names`). A name the files also hold is
        refused, naming both."""
        pairs = [(s, m) for s, m in names.items() if s in self.where]
        pairs += [(f"{s}_scale", f"{m}_scale") for s, m in pairs if f"{s}_scale" in self.where]
        for stored, name in pairs:
            if name in self.where:
                raise CheckpointError(f"{stored} is read as {name}, which the checkpoint also holds")
            self.where[name], self.shapes[name] = self.where.pop(stored), self.shapes.pop(stored)
            self.dtypes[name] = self.dtypes.pop(stored)
            if stored in self.stored:  # a weight_scale read from weight_scale_inv
                self.stored[name] = self.stored.pop(stored)
            else:
                self.renamed[name] = stored

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def load(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        inverse = name in self.stored  # weight_scale_inv: float32 powers of two read as E8M0 bytes
        stored = self.stored[name] if inverse else self.renamed.get(name, name)
        try:
            with safe_open(str(self.where[name]), framework="pt") as handle:
                tensor = handle.get_tensor(stored)
        except Exception as exc:
            raise CheckpointError(f"{self.where[name]}: cannot read {stored} ({str(exc).splitlines()[0]})") from None
        return _e8m0_of_powers_of_two(stored, tensor) if tensor.dtype == torch.float32 and inverse else tensor


def _e8m0_of_powers_of_two(name: str, scale: torch.Tensor) -> torch.Tensor:
    """float32 scales that are powers of two (2^-127 .. 2^127) as E8M0 bytes (uint8), else
    :class:`CheckpointError` naming the tensor."""
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2^exponent, mantissa in [0.5, 1) where positive
    biased = exponent.to(torch.int32) - 1 + 127
    if not bool(((mantissa == 0.5) & (biased >= 0) & (biased <= 254)).all()):
        raise CheckpointError(f"{name}: float32 scales that are not all powers of two from 2^-127 to 2^127 (E8M0)")
    return biased.to(torch.uint8)


def check_pair(name: str, source: TensorSource, module: nn.Linear) -> None:
    """Refuse, naming the tensor, a quantized layer ``name`` of the model's ``module`` whose ``weight`` /
    ``weight_scale`` pair in ``source`` is missing, or of a dtype or shape other than MXFP8's for that layer."""
    weight, scale = f"{name}.weight", f"{name}.weight_scale"
    if weight not in source:
        raise CheckpointError(f"{scale} is present but {weight} is missing")
    if scale not in source:
        raise CheckpointError(f"{weight} is present but {scale} is missing: the layer cannot be dequantized")
    if source.dtypes[weight] != torch.float8_e4m3fn:
        raise CheckpointError(f"{weight} has dtype {source.dtypes[weight]}; MXFP8 weights are float8_e4m3fn")
    if source.dtypes[scale] not in SCALE_DTYPES:
        raise CheckpointError(f"{scale} has dtype {source.dtypes[scale]}; E8M0 scales are uint8 or float8_e8m0fnu")
    if source.shapes[weight] != (module.out_features, module.in_features):
        raise CheckpointError(
            f"{weight} has shape {source.shapes[weight]}; the model's layer is [{module.out_features}, "
            f"{module.in_features}]"
        )
    if module.in_features % BLOCK_SIZE:
        raise CheckpointError(f"{name}: in_features={module.in_features} is not a multiple of {BLOCK_SIZE}")
    if source.shapes[scale] != (module.out_features, module.in_features // BLOCK_SIZE):
        raise CheckpointError(
            f"{scale} has shape {source.shapes[scale]}, expected [{module.out_features}, "
            f"{module.in_features // BLOCK_SIZE}]"
        )


def check_values(name: str, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Refuse a layer whose weight would not dequantize to finite values: every output it touches would be NaN or
    infinite."""
    reason = nonfinite_reason(weight, scale)
    if reason:
        raise CheckpointError(f"{name}.weight / weight_scale {reason}: every output it touches would not be finite")


@dataclass(frozen=True)
class LoadReport:
    format: CheckpointFormat
    quantized: tuple[str, ...]  # layers now MXFP8Linear
    tied: tuple[str, ...]  # parameters not in the checkpoint because they share storage with one that is
    fusion: tuple[str, ...] = ()  # :func:`mxgemm.fusion.fuse`'s account, one line a group or gated MLP
    experts: tuple[str, ...] = ()  # experts modules now MXFP8Experts
    dequantized: tuple[str, ...] = ()  # MXFP8 experts loaded into the model's own bf16 experts, with the reason

    def __str__(self) -> str:
        counted = tally(self.fusion)
        fused, gated = counted.fused, counted.gated
        groups = f", {fused} groups of layers sharing an input run as one" if fused else ""
        groups += "".join(f" ({n} of them: {what})" for what, n in counted.regimes.items())
        groups += f", {gated} gated MLPs' products quantized for down_proj in one kernel" if gated else ""
        groups += f", {len(self.experts)} MXFP8 experts modules" if self.experts else ""
        groups += f" ({counted.graphed} of their blocks graphed in eager decode)" if counted.graphed else ""
        groups += "".join(f"; {line}" for line in self.dequantized)
        return f"{self.format.kind} {self.format.scheme}: {len(self.quantized)} MXFP8 layers loaded{groups}"


def load_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    backend: str | None = None,
    recipe: str | None = None,
    device: str | torch.device | None = None,
    fuse: bool = True,
) -> LoadReport:
    """Load an MXFP8 checkpoint into ``model`` (built from the checkpoint's config, e.g. ``from_config``).

    Each ``nn.Linear`` the checkpoint quantizes becomes an ``MXFP8Linear``; every other tensor is loaded as is. The
    files are read lazily, one tensor at a time, each placed on ``device`` (default: where the model's tensors are)
    as it is read, so host memory holds about one tensor and the GPU never holds a full-precision copy of a quantized
    layer. A model whose parameters are on the meta device (``accelerate.init_empty_weights()``) gets them from the
    checkpoint and needs ``device``; a tensor that would stay on meta is an error naming it.

    The whole checkpoint is checked, and every quantized layer built, before the model changes, so a load either
    completes or leaves the model as it was: tensors that do not fit raise :class:`CheckpointError` naming the tensor
    (or the file, for unreadable ones); so do tensors the model lacks, tensors in two files, NaN scales and
    parameters the checkpoint lacks (unless tied to one it has). ``fuse``: then make each layer's q, k and v
    projections, and its gate and up projections, run as one, and its gated MLP hand ``down_proj`` the product
    quantized in one kernel, and its MoE blocks replay their router and experts as one CUDA graph in eager decode
    calls (:func:`mxgemm.fusion.fuse`).

    Experts stored per expert (``<experts>.<e>.{gate,up,down}_proj.weight``, as compressed-tensors, ModelOpt and
    :func:`save_checkpoint` write them) fill a model's 3-D experts (transformers' ``gate_up_proj`` / ``down_proj``):
    MXFP8 ones become an ``MXFP8Experts`` (they are dequantized into the model's own experts instead, and the report
    says why, where the experts compute other than MXFP8Experts, :func:`mxgemm.moe.experts_unfit_reason`, and on a
    GPU where ``auto`` finds no grouped backend but the emulation); bf16 ones are stacked into the model's tensors.
    """
    fmt = read_format(path)
    source = TensorSource(path)
    source.rename(stored_to_model_names(model))  # a transformers model's checkpoint names, as its converters store them
    target = _target_device(model, device)
    experts, consumed, stacked = experts_in(model, source)
    kept = experts_stay_in_bf16(target, backend, recipe) if experts else ""
    experts_to_dequantize = dict.fromkeys(experts, kept) if kept else {}
    for name in experts:  # experts computing other than MXFP8Experts run their own steps on their own tensors
        reason = experts_unfit_reason(model.get_submodule(name))
        if reason:
            experts_to_dequantize[name] = reason
    plans = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or f"{name}.weight_scale" not in source:
            if type(module) is nn.Linear and source.dtypes.get(f"{name}.weight") == torch.float8_e4m3fn:
                raise CheckpointError(f"{name}.weight is float8 but {name}.weight_scale is missing")
            continue
        check_pair(name, source, module)
        bias = f"{name}.bias" if f"{name}.bias" in source else None
        if bias is not None and (module.bias is None or source.shapes[bias] != tuple(module.bias.shape)):
            raise CheckpointError(
                f"{bias} has shape {source.shapes[bias]}; the model's layer has "
                f"{'no bias' if module.bias is None else tuple(module.bias.shape)}"
            )
        plans.append((name, module, bias))
        consumed |= {f"{name}.weight", f"{name}.weight_scale", bias}
    rest = [k for k in source.where if k not in consumed]
    leftover_scales = [k for k in rest if k.endswith(".weight_scale")]
    if leftover_scales:
        raise CheckpointError(f"{leftover_scales[0]} belongs to no nn.Linear of the model")
    state = model.state_dict(keep_vars=True)
    unexpected = [k for k in rest if k not in state]
    if unexpected:
        raise CheckpointError(f"the model has no tensor named {unexpected[0]} (and {len(unexpected) - 1} more)")
    for k in rest:
        if source.shapes[k] != tuple(state[k].shape):
            raise CheckpointError(f"{k} has shape {source.shapes[k]}; the model's is {tuple(state[k].shape)}")
    groups = tied_groups(model)  # names sharing one tensor object (tied weights)
    replaced = {f"{name}.{p}" for name, *_ in plans for p in ("weight", "bias")}
    given = {g for k in [*rest, *stacked] for g in groups.get(k, (k,))}  # stacked: experts' 3-D tensors
    retie = _declared_ties(model)  # ties the model makes itself (transformers' tie_weights) once loaded
    given |= {alias for alias, origin in retie.items() if origin in given}
    missing = [k for k in state if k not in given and k not in replaced and not _is_mx_buffer(model, k)]
    if missing:
        raise CheckpointError(f"the checkpoint has no tensor for {missing[0]} (and {len(missing) - 1} more)")
    left_on_meta = [k for k, t in _all_tensors(model) if t.is_meta and k not in given and k not in replaced]
    if left_on_meta:
        raise CheckpointError(
            f"{left_on_meta[0]} is on the meta device and not in the checkpoint ({len(left_on_meta)} such tensors): "
            "build the model with its buffers on a device (accelerate.init_empty_weights() keeps them by default)"
        )
    tied = [k for k in state if k not in rest and k in given]

    layers = {}  # built before any is put in: a bad scale or a backend that cannot run leaves the model as it was
    for name, module, bias in plans:
        scale = e8m0_bytes(source.load(f"{name}.weight_scale"))
        weight = source.load(f"{name}.weight")
        check_values(name, weight, scale)
        b = None if bias is None else source.load(bias).to(device=target, dtype=module.bias.dtype)
        weight = weight.to(target)
        layers[name] = MXFP8Linear.from_quantized(weight, scale.to(target), b, backend=backend, recipe=recipe)
        del weight
    modules = {}
    for name, names in experts.items():
        if name in experts_to_dequantize:  # checked now, loaded below: the model is not changed yet
            for n in (n for ns in names.values() for n in ns):
                check_values(n.removesuffix(".weight"), source.load(n), e8m0_bytes(source.load(f"{n}_scale")))
        else:
            modules[name] = _load_experts(names, source, target, backend, recipe)
    for name, layer in [*layers.items(), *modules.items()]:
        model.set_submodule(name, layer)
    for k in rest:
        _assign(model, groups.get(k, (k,)), source.load(k), target)
    for k, (names, quantized) in stacked.items():
        if k.rpartition(".")[0] not in modules:  # experts kept in the model's own tensors
            _assign(model, groups.get(k, (k,)), _stack_experts(source, names, quantized), target)
    if retie:
        model.tie_weights()
    model.to(target)
    fusion = tuple(fuse_model(model)) if fuse else ()
    dequantized = tuple(f"{name} in bf16: {reason}" for name, reason in experts_to_dequantize.items())
    return LoadReport(fmt, tuple(layers), tuple(tied), fusion, tuple(modules), dequantized)


def experts_in(model: nn.Module, source: TensorSource, stored: dict[str, dict[str, list[str]]] | None = None):
    """The experts modules of ``model`` (3-D ``gate_up_proj`` / ``down_proj``) whose experts the checkpoint stores per
    expert (``<experts>.<e>.{gate,up,down}_proj.weight``, with ``weight_scale`` where quantized; ``stored``: other
    names, by module and projection), checked: (the quantized ones by name, the checkpoint names they consume, {the
    model's 3-D tensor name: (the per-expert names stacked into it, quantized)} for the experts to load into the
    model's own tensors (bf16 in the checkpoint)."""
    experts, consumed, stacked = {}, set(), {}
    for name, module in experts_modules(model):
        gate_up = module.gate_up_proj
        if not (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3):
            continue
        count = gate_up.shape[0]
        names = (stored or {}).get(name) or per_expert_names(name, count)
        if names["gate_proj"][0] not in source:
            continue
        absent = [n for ns in names.values() for n in ns if n not in source]
        if absent:
            raise CheckpointError(f"{absent[0]} is missing: {name} has {count} experts ({len(absent)} tensors missing)")
        quantized = f"{names['gate_proj'][0]}_scale" in source
        shapes = per_expert_shapes(module)
        for p, ns in names.items():
            for n in ns:
                out_features, in_features = shapes[p]
                layer = _Shape(out_features, in_features)
                if quantized:
                    check_pair(n.removesuffix(".weight"), source, layer)
                elif source.shapes[n] != shapes[p]:
                    raise CheckpointError(
                        f"{n} has shape {source.shapes[n]}; the model's experts are {list(shapes[p])}"
                    )
        consumed |= {n for ns in names.values() for n in ns}
        if quantized:
            reason = experts_layout_reason(module)
            if reason:
                raise CheckpointError(f"{name} holds MXFP8 experts that MXFP8Experts cannot take: {reason}")
            consumed |= {f"{n}_scale" for ns in names.values() for n in ns}
            experts[name] = names
        prefix = f"{name}." if name else ""
        stacked[prefix + "gate_up_proj"] = ((names["gate_proj"], names["up_proj"]), quantized)
        stacked[prefix + "down_proj"] = ((names["down_proj"],), quantized)
    return experts, consumed, stacked


@dataclass(frozen=True)
class _Shape:
    out_features: int
    in_features: int


def _stacked(source: TensorSource, groups: tuple[list[str], ...], quantized: bool):
    """The per-expert tensors of ``groups`` (gate and up, or down) joined into ``[E, rows, K]``, each expert's groups
    concatenated by rows: (weights, scales) where stored as MXFP8 (their values checked), else (weights, None)."""
    weights, scales = [], []
    for e in range(len(groups[0])):
        names = [g[e] for g in groups]
        loaded = [source.load(n) for n in names]
        weights.append(torch.cat(loaded))
        if quantized:
            expert_scales = [e8m0_bytes(source.load(f"{n}_scale")) for n in names]
            for n, weight, scale in zip(names, loaded, expert_scales, strict=True):
                check_values(n.removesuffix(".weight"), weight, scale)
            scales.append(torch.cat(expert_scales))
    return torch.stack(weights), (torch.stack(scales) if quantized else None)


def _stack_experts(source: TensorSource, groups: tuple[list[str], ...], quantized: bool) -> torch.Tensor:
    """The model's own 3-D experts tensor from per-expert tensors (dequantized to fp32 where stored as MXFP8)."""
    weights, scales = _stacked(source, groups, quantized)
    return weights if scales is None else dequantize(MXTensor(weights, scales))


def _load_experts(names: dict, source: TensorSource, device, backend, recipe) -> MXFP8Experts:
    """The :class:`MXFP8Experts` of an experts module from its per-expert MXFP8 tensors, checked, on ``device``."""
    gate_up, down = (
        _stacked(source, tuple(names[p] for p in projections), quantized=True)
        for projections in (("gate_proj", "up_proj"), ("down_proj",))
    )
    tensors = [t.to(device) for t in (*gate_up, *down)]
    return MXFP8Experts.from_quantized(*tensors, backend=backend, recipe=recipe)


def _declared_ties(model: nn.Module) -> dict[str, str]:
    """alias -> origin for the weights a transformers model ties itself (``tie_word_embeddings``, through
    ``tie_weights``): under ``accelerate.init_empty_weights`` its tied parameters are separate meta tensors until
    it ties them again."""
    keys = getattr(model, "_tied_weights_keys", None)
    config = getattr(model, "config", None)
    if (
        not isinstance(keys, dict)
        or not getattr(config, "tie_word_embeddings", False)
        or not hasattr(model, "tie_weights")
    ):
        return {}
    return {alias: origin for alias, origin in keys.items() if isinstance(alias, str) and isinstance(origin, str)}


def _target_device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in (*model.parameters(), *model.buffers()):
        if not t.is_meta:
            return t.device
    raise CheckpointError("the model's tensors are all on the meta device: pass device= to say where to load it")


def _all_tensors(model: nn.Module):
    for prefix, module in model.named_modules():
        for kind in (module._parameters, module._buffers):
            for attr, t in kind.items():
                if t is not None:
                    yield (f"{prefix}.{attr}" if prefix else attr), t


def tied_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every tensor name mapped to all the names of the same tensor object (more than one where weights are tied)."""
    by_id: dict[int, list[str]] = {}
    for name, t in _all_tensors(model):
        by_id.setdefault(id(t), []).append(name)
    return {name: tuple(names) for names in by_id.values() for name in names}


def _assign(model: nn.Module, names: tuple[str, ...], value: torch.Tensor, device: torch.device) -> None:
    """Put ``value`` where every one of ``names`` (one tensor, tied names included) is: copied in place when that
    tensor already lives on ``device``, else a new tensor there in its dtype (the old one is freed)."""
    owner, _, attr = names[0].rpartition(".")
    module = model.get_submodule(owner) if owner else model
    old = getattr(module, attr)
    if not old.is_meta and old.device == device:
        with torch.no_grad():
            old.copy_(value)
        return
    new = value.to(device=device, dtype=old.dtype)
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(new, requires_grad=old.requires_grad)
    for name in names:
        owner, _, attr = name.rpartition(".")
        holder = model.get_submodule(owner) if owner else model
        (holder._parameters if attr in holder._parameters else holder._buffers)[attr] = new


def _reverted(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """``state`` (names of ``model``'s tensors) under the names transformers stores them under, its converters
    reverted (``revert_weight_conversion``); None where ``model`` is not a transformers model."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return revert_weight_conversion(model, state) if isinstance(model, PreTrainedModel) else None


def _stored_under(model: nn.Module, names: Sequence[str]) -> dict[str, str]:
    """The names transformers stores ``names`` (names of ``model``'s tensors) under -> the name each comes from: the
    model's converters reverted on a tensor of one element per name that carries which it is; what those converters
    give back as more than one element is left out (everything, for models that are not transformers models)."""
    coded = {n: torch.full((1,), float(i), dtype=torch.float64, device="cpu") for i, n in enumerate(names)}
    reverted = _reverted(model, coded) or {}
    return {key: names[int(v.item())] for key, v in reverted.items() if v.numel() == 1}


def stored_expert_names(model: nn.Module, *, quantized: bool = False) -> dict[str, dict[str, list[str]]]:
    """For each experts module of ``model`` (transformers' 3-D experts, or an :class:`MXFP8Experts`; ``quantized``:
    those only), the names its checkpoints store its experts' weights under, by projection and expert:
    ``<experts>.<e>.{gate,up,down}_proj.weight`` for Qwen-MoE and DeepSeek-V3,
    ``<layer>.block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` for Mixtral. Found by reverting the model's own
    converters (transformers' ``revert_weight_conversion``) on tensors of one element per expert and projection
    that carry which they are; a module whose experts do not come back one tensor per expert and projection has no
    entry (transformers then stores them stacked). Models that are not transformers models:
    :func:`mxgemm.moe.per_expert_names`."""
    names = {}
    for name, module in model.named_modules():
        if isinstance(module, MXFP8Experts):
            count = module.num_experts
        elif not quantized and is_experts_module(module):
            count = module.gate_up_proj.shape[0]
        else:
            continue
        prefix = f"{name}." if name else ""
        code = torch.arange(count, dtype=torch.float64, device="cpu")  # gate 2e, up 2e + 1, down 2E + e
        coded = {
            f"{prefix}gate_up_proj": torch.stack([2 * code, 2 * code + 1], dim=1)[:, :, None],
            f"{prefix}down_proj": (2 * count + code)[:, None, None],
        }
        stored = _reverted(model, coded)
        if stored is None:
            names[name] = per_expert_names(name, count)
            continue
        found = {p: [""] * count for p in PROJECTIONS}
        for key, value in stored.items():
            v = int(value.flatten()[0]) if value.numel() == 1 and key.endswith(".weight") else -1
            if v < 0:
                break
            p, e = (PROJECTIONS[v % 2], v // 2) if v < 2 * count else ("down_proj", v - 2 * count)
            found[p][e] = key
        if len(stored) == 3 * count and all(all(ns) for ns in found.values()):
            names[name] = found
    return names


def stored_to_model_names(model: nn.Module, experts: dict[str, dict[str, list[str]]] | None = None) -> dict[str, str]:
    """The names ``model``'s checkpoints store its tensors under -> its own names (transformers' renamings, such as
    Mixtral's ``block_sparse_moe`` for ``mlp``), per-expert tensors (``experts``, by default
    :func:`stored_expert_names`) -> their :func:`mxgemm.moe.per_expert_names`; only the names that differ. Where the
    model's converters do not take tensors of one element (converters of tensors other than experts), only the
    experts' names."""
    experts = stored_expert_names(model) if experts is None else experts
    stacked = {
        f"{name}.{t}".lstrip(".")
        for name, module in model.named_modules()
        if is_experts_module(module)
        for t in ("gate_up_proj", "down_proj")
    }  # converters of stacked tensors would not take one element
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    keys = [k for k, _ in named if k not in stacked]  # names only: a state dict would export MX tensors
    try:
        stored = _stored_under(model, keys)
    except (RuntimeError, ValueError, IndexError):  # a converter of other tensors that does not take one element
        stored = {}
    names = {s: k for s, k in stored.items() if s != k}
    names.update(_renamed_stacks(model, sorted(stacked)))
    for name, by_projection in experts.items():
        own = per_expert_names(name, len(by_projection["gate_proj"]))
        for p, stored in by_projection.items():
            names.update((s, m) for s, m in zip(stored, own[p], strict=True) if s != m)
    return names


def stored_layer_names(model: nn.Module, experts: dict[str, dict[str, list[str]]] | None = None) -> dict[str, str]:
    """Module names of ``model``'s layers -> the names its checkpoints store them under, where transformers' renamings
    make them differ (DeepSeek-V4's ``mlp.shared_experts.gate_proj`` stored as ``ffn.shared_experts.w1``):
    :func:`stored_to_model_names` of the ``weight`` tensors, reversed."""
    renamed = stored_to_model_names(model, experts).items()
    return {m.removesuffix(".weight"): s.removesuffix(".weight") for s, m in renamed if m.endswith(".weight")}


def _renamed_stacks(model: nn.Module, names: Sequence[str]) -> dict[str, str]:
    """The names transformers stores stacked experts' tensors ``names`` under -> each name, where the model's
    converters only rename it (GraniteMoe's ``block_sparse_moe.input_linear`` for ``gate_up_proj``): reverted on a
    coded [1, 1, 1] tensor, a rename gives back one 3-D tensor; converters that store experts per expert give more,
    or 2-D ones."""
    renamed = {}
    for name in names:
        try:
            reverted = _reverted(model, {name: torch.zeros((1, 1, 1), dtype=torch.float64, device="cpu")}) or {}
        except (RuntimeError, ValueError, IndexError):
            continue
        if len(reverted) == 1:
            ((stored, tensor),) = reverted.items()
            if tensor.dim() == 3 and stored != name:
                renamed[stored] = name
    return renamed


def stored_module_names(model: nn.Module, modules: Sequence[str]) -> dict[str, str]:
    """Module names of ``model`` -> the names its checkpoints store them under (transformers' renamings, such as
    Mixtral's ``mlp`` stored as ``block_sparse_moe``, reverted); the same names for other models."""
    mark = ".__mxgemm_module__"
    stored = _stored_under(model, [m + mark for m in modules])
    named = {m.removesuffix(mark): s.removesuffix(mark) for s, m in stored.items() if s.endswith(mark)}
    return {m: named.get(m, m) for m in modules}


def per_expert_state(
    model: nn.Module, state: dict[str, torch.Tensor], stored: dict[str, dict[str, list[str]]] | None = None
) -> dict[str, torch.Tensor]:
    """``state`` with each :class:`MXFP8Experts`' stacked MX tensors written per expert, as compressed-tensors and
    ModelOpt store experts: ``<experts>.<e>.{gate,up,down}_proj.weight`` and ``.weight_scale`` (``stored``: other
    weight names, by module and projection)."""
    for name, module in model.named_modules():
        if not isinstance(module, MXFP8Experts):
            continue
        prefix = f"{name}." if name else ""
        gate_up, gate_up_scale = state.pop(prefix + "gate_up_proj"), state.pop(prefix + "gate_up_proj_scale")
        down, down_scale = state.pop(prefix + "down_proj"), state.pop(prefix + "down_proj_scale")
        width = down.shape[-1]
        names = (stored or {}).get(name) or per_expert_names(name, module.num_experts)
        for e in range(module.num_experts):
            for proj, weight, scale in (
                ("gate_proj", gate_up[e, :width], gate_up_scale[e, :width]),
                ("up_proj", gate_up[e, width:], gate_up_scale[e, width:]),
                ("down_proj", down[e], down_scale[e]),
            ):
                state[names[proj][e]], state[f"{names[proj][e]}_scale"] = weight, scale
    return state


def unquantized_owners(model: nn.Module, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The modules of ``model`` that own a tensor of ``shapes`` (names as in its state dict or a checkpoint, to their
    shapes) of two or more dimensions kept in high precision: every owner but ``MXFP8Linear`` layers and embeddings
    (``nn.Linear`` layers left as they were, routers, the experts of a mixture of experts, whose per-expert tensors
    belong to the experts module). A checkpoint names them in ``ignore`` so that no reader takes them for quantized."""
    modules = dict(model.named_modules())
    owners = []
    for name, shape in shapes.items():
        owner = name.rpartition(".")[0]
        while owner and owner not in modules:  # per-expert tensors: mlp.experts.0.gate_proj.weight -> mlp.experts
            owner = owner.rpartition(".")[0]
        module = modules.get(owner)
        if len(shape) >= 2 and owner and not isinstance(module, (MXFP8Linear, MXFP8Experts, nn.Embedding)):
            owners.append(owner)
    return list(dict.fromkeys(owners))


def clear_checkpoint(folder: Path) -> None:
    """Remove the safetensors checkpoint a folder holds (its index, the shards it names, ``model.safetensors`` and
    shards named as transformers names them), so that a checkpoint written there is the only one read from it.
    Links are removed, never followed; names an index gives that are not file names of the folder are left."""
    folder = Path(folder)
    names = {"model.safetensors", INDEX, *(f.name for f in folder.glob("model-*-of-*.safetensors"))}
    try:
        weight_map = _read_json(folder / INDEX).get("weight_map") if (folder / INDEX).exists() else None
    except CheckpointError:
        weight_map = None  # unreadable: the index itself still goes
    if isinstance(weight_map, dict):
        names.update(n for n in weight_map.values() if isinstance(n, str) and n == Path(n).name and n != "..")
    for name in names:
        path = folder / name
        if path.is_symlink() or path.is_file():
            path.unlink()


def _is_mx_buffer(model: nn.Module, key: str) -> bool:
    owner, _, _ = key.rpartition(".")
    return isinstance(model.get_submodule(owner), MXFP8Linear) if owner else False


def save_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    *,
    scheme: str = "MXFP8",
    config: dict | None = None,
    progress: Callable[[Sequence[str]], Sequence[str]] | None = None,
) -> Path:
    """Write ``model`` (its ``MXFP8Linear`` layers and ``MXFP8Experts`` quantized, everything else as is) as a
    compressed-tensors MXFP8 checkpoint: ``model.safetensors`` and ``config.json`` (``config`` plus its
    ``quantization_config``).

    Experts are written per expert (``<experts>.<e>.{gate,up,down}_proj.weight`` and ``weight_scale``, as other
    producers store them). Every module whose weights stay in high precision and that a reader of ``targets:
    ["Linear"]`` could take for a quantized layer is listed in ``ignore`` (:func:`unquantized_owners`: ``nn.Linear``
    layers that are not ``MXFP8Linear``, routers, experts left in bf16). An earlier checkpoint in ``out_dir`` is
    removed first (:func:`clear_checkpoint`). Tensors that share storage (tied weights) are written once.
    ``progress`` wraps the iteration over state-dict names (e.g. a progress bar).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    clear_checkpoint(out)
    state = per_expert_state(model, model.state_dict())
    ignore = unquantized_owners(model, {name: tuple(t.shape) for name, t in state.items()})
    names = list(state)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, torch.dtype]] = set()
    for name in progress(names) if progress else names:
        t = state[name]
        key = (t.data_ptr(), t.dtype)
        if t.numel() and key in seen:
            continue  # tied: written under its first name
        seen.add(key)
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config or {})
    cfg["quantization_config"] = compressed_tensors_config(scheme, ignore)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    return out
