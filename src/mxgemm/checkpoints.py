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
from .format import BLOCK_SIZE, E8M0_NAN
from .linear import MXFP8Linear

__all__ = ["SCHEMES", "CheckpointError", "CheckpointFormat", "load_checkpoint", "read_format", "save_checkpoint"]


class CheckpointError(MXGemmError, ValueError):
    """A checkpoint that is not an MXFP8 checkpoint mxgemm can load, with the tensor or file at fault."""


def _mx_args(dynamic: bool) -> dict:
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "group_size": BLOCK_SIZE,
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
        "format": "mxfp8-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


@dataclass(frozen=True)
class CheckpointFormat:
    kind: str  # "compressed-tensors" or "modelopt"
    scheme: str  # "MXFP8" (dynamic MX activations), "MXFP8A16" (weight-only), or "MXFP8" for ModelOpt
    ignore: tuple[str, ...]  # module names or patterns left unquantized


def read_format(path: str | Path) -> CheckpointFormat:
    """Which MXFP8 format the checkpoint folder declares; :class:`CheckpointError` if none."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    config = _read_json(path / "config.json") if (path / "config.json").exists() else {}
    qc = config.get("quantization_config") or config.get("compression_config")
    if (path / "hf_quant_config.json").exists():
        q = _read_json(path / "hf_quant_config.json").get("quantization", {})
        return _modelopt_format(q, path / "hf_quant_config.json")
    if qc and qc.get("quant_method") == "modelopt":
        return _modelopt_format(qc, path / "config.json")
    if qc and qc.get("quant_method") == "compressed-tensors":
        if qc.get("format") != "mxfp8-quantized":
            raise CheckpointError(
                f"{path / 'config.json'}: compressed-tensors format {qc.get('format')!r} is not mxfp8-quantized"
            )
        groups = list((qc.get("config_groups") or {}).values())
        if not groups:
            raise CheckpointError(f"{path / 'config.json'}: quantization_config has no config_groups")
        acts = groups[0].get("input_activations")
        scheme = "MXFP8" if acts and acts.get("dynamic") and acts.get("group_size") == BLOCK_SIZE else "MXFP8A16"
        return CheckpointFormat("compressed-tensors", scheme, tuple(qc.get("ignore") or ()))
    raise CheckpointError(
        f"{path}: no MXFP8 quantization config (config.json quantization_config or hf_quant_config.json)"
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a {type(data).__name__}, not a JSON object")
    return data


def _modelopt_format(q: dict, where: Path) -> CheckpointFormat:
    if q.get("quant_algo") != "MXFP8":
        raise CheckpointError(f"{where}: ModelOpt quant_algo {q.get('quant_algo')!r} is not MXFP8")
    return CheckpointFormat("modelopt", "MXFP8", tuple(q.get("exclude_modules") or ()))


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in the folder."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except Exception as exc:  # safetensors' own error (truncated file, bad header, ...) names no file
            raise CheckpointError(f"{f}: not a readable safetensors file ({str(exc).splitlines()[0]})") from None
        for name in part:
            if name in where:
                raise CheckpointError(f"{name} is in two files, {where[name].name} and {f.name}")
            where[name] = f
        tensors.update(part)
    return tensors


def _check_pair(name: str, weight: torch.Tensor | None, scale: torch.Tensor, module: nn.Linear) -> None:
    if weight is None:
        raise CheckpointError(f"{name}.weight_scale is present but {name}.weight is missing")
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{name}.weight has dtype {weight.dtype}; MXFP8 weights are float8_e4m3fn")
    if scale.dtype != torch.uint8:
        raise CheckpointError(f"{name}.weight_scale has dtype {scale.dtype}; E8M0 scales are uint8")
    if tuple(weight.shape) != (module.out_features, module.in_features):
        raise CheckpointError(
            f"{name}.weight has shape {tuple(weight.shape)}; the model's layer is "
            f"[{module.out_features}, {module.in_features}]"
        )
    if module.in_features % BLOCK_SIZE:
        raise CheckpointError(f"{name}: in_features={module.in_features} is not a multiple of {BLOCK_SIZE}")
    if tuple(scale.shape) != (module.out_features, module.in_features // BLOCK_SIZE):
        raise CheckpointError(
            f"{name}.weight_scale has shape {tuple(scale.shape)}, expected "
            f"[{module.out_features}, {module.in_features // BLOCK_SIZE}]"
        )
    nan = (scale == E8M0_NAN).nonzero()
    if len(nan):
        raise CheckpointError(
            f"{name}.weight_scale holds the E8M0 NaN code 255 at {tuple(nan[0].tolist())} ({len(nan)} in all): "
            "that block would make every output it touches NaN"
        )


@dataclass(frozen=True)
class LoadReport:
    format: CheckpointFormat
    quantized: tuple[str, ...]  # layers now MXFP8Linear
    tied: tuple[str, ...]  # parameters not in the checkpoint because they share storage with one that is

    def __str__(self) -> str:
        return f"{self.format.kind} {self.format.scheme}: {len(self.quantized)} MXFP8 layers loaded"


def load_checkpoint(
    model: nn.Module,
    path: str | Path,
    *,
    backend: str | None = None,
    recipe: str | None = None,
    device: str | torch.device | None = None,
) -> LoadReport:
    """Load an MXFP8 checkpoint into ``model`` (built from the checkpoint's config, e.g. ``from_config``).

    Each ``nn.Linear`` the checkpoint quantizes becomes an ``MXFP8Linear``; every other tensor is loaded as is. The
    whole checkpoint is checked before the model changes, so a load either completes or leaves the model as it was:
    tensors that do not fit raise :class:`CheckpointError` naming the tensor (or the file, for unreadable ones); so do
    tensors the model lacks, tensors in two files, NaN scales and parameters the checkpoint lacks (unless tied to one
    it has). ``device``: where the model ends up (default: where it is). Building the model on the CPU and loading
    with ``device="cuda"`` keeps the GPU at the final footprint plus one layer's transients: each MX weight goes to
    the GPU only to be prepared there. A model on the meta device is refused (its buffers have no values to keep).
    """
    fmt = read_format(path)
    tensors = read_tensors(path)
    target = torch.device(device) if device is not None else _model_device(model)
    on_meta = [k for k, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    on_meta += [f"{n}.{b}" for n, m in model.named_modules() for b, t in m._buffers.items() if t is not None
                and t.is_meta and f"{n}.{b}".lstrip(".") not in on_meta]  # fmt: skip
    if on_meta:
        raise CheckpointError(
            f"the model holds tensors on the meta device ({on_meta[0]}, {len(on_meta)} in all): build it on the CPU "
            "(e.g. from_config under torch.device('cpu')) and pass device= to load it where it should run"
        )
    plans = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or f"{name}.weight_scale" not in tensors:
            if type(module) is nn.Linear and tensors.get(f"{name}.weight", torch.empty(0)).dtype == torch.float8_e4m3fn:
                raise CheckpointError(f"{name}.weight is float8 but {name}.weight_scale is missing")
            continue
        scale = tensors.pop(f"{name}.weight_scale")
        weight = tensors.pop(f"{name}.weight", None)
        _check_pair(name, weight, scale, module)
        bias = tensors.pop(f"{name}.bias", None)
        if bias is not None and (module.bias is None or bias.shape != module.bias.shape):
            raise CheckpointError(f"{name}.bias has shape {tuple(bias.shape)}; the model's layer has "
                                  f"{'no bias' if module.bias is None else tuple(module.bias.shape)}")  # fmt: skip
        plans.append((name, module, weight, scale, bias))
    leftover_scales = [k for k in tensors if k.endswith(".weight_scale")]
    if leftover_scales:
        raise CheckpointError(f"{leftover_scales[0]} belongs to no nn.Linear of the model")
    state = model.state_dict()
    unexpected = [k for k in tensors if k not in state]
    if unexpected:
        raise CheckpointError(f"the model has no tensor named {unexpected[0]} (and {len(unexpected) - 1} more)")
    for k, t in tensors.items():
        if t.shape != state[k].shape:
            raise CheckpointError(f"{k} has shape {tuple(t.shape)}; the model's is {tuple(state[k].shape)}")
    replaced = {f"{name}.{p}" for name, *_ in plans for p in ("weight", "bias")}
    loaded_ptrs = {state[k].data_ptr() for k in tensors}
    missing = [k for k in state if k not in tensors and k not in replaced and not _is_mx_buffer(model, k)]
    tied = [k for k in missing if state[k].data_ptr() in loaded_ptrs]
    untied = [k for k in missing if k not in tied]
    if untied:
        raise CheckpointError(f"the checkpoint has no tensor for {untied[0]} (and {len(untied) - 1} more)")

    layers = {}  # built before any is put in: a backend that cannot run leaves the model as it was
    for name, module, weight, scale, bias in plans:
        if bias is not None:
            bias = bias.to(device=target, dtype=module.bias.dtype)
        layers[name] = MXFP8Linear.from_quantized(
            weight.to(target), scale.to(target), bias, backend=backend, recipe=recipe
        )
    for name, layer in layers.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    model.load_state_dict(tensors, strict=False)
    model.to(target)
    return LoadReport(fmt, tuple(layers), tuple(tied))


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


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
    """Write ``model`` (its ``MXFP8Linear`` layers quantized, everything else as is) as a compressed-tensors MXFP8
    checkpoint: ``model.safetensors`` and ``config.json`` (``config`` plus its ``quantization_config``).

    ``nn.Linear`` layers that are not ``MXFP8Linear`` are listed in ``ignore``. Tensors that share storage (tied
    weights) are written once. ``progress`` wraps the iteration over state-dict names (e.g. a progress bar).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ignore = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    state = model.state_dict()
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
