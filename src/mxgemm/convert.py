"""Quantize a Hugging Face model folder to a compressed-tensors MXFP8 checkpoint, streaming: tensor by tensor from the
source's safetensors shards into output shards, so host memory holds about one output shard and one tensor whatever
the model's size. The model itself is never built: its linear layers are read off a model built on the meta device
from its config.

Each quantized ``<layer>.weight`` becomes float8_e4m3fn ``<layer>.weight`` and uint8 ``<layer>.weight_scale``
(:func:`mxgemm.quantize`, the bytes ``quantize_model`` + ``save_checkpoint`` write); every other tensor is copied as
stored. Shards are named and indexed as transformers names them (``model-00001-of-00003.safetensors`` and
``model.safetensors.index.json``; a single ``model.safetensors`` when one shard holds everything).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .checkpoints import (
    CheckpointError,
    TensorSource,
    clear_checkpoint,
    compressed_tensors_config,
    stored_expert_names,
    stored_module_names,
    stored_to_model_names,
    tied_groups,
    unquantized_owners,
)
from .format import ScaleMode, quantize
from .models import LayerReport, QuantizeReport, hf_meta_model, matches_skip, router_names, skip_reason
from .moe import experts_modules, experts_unfit_reason, per_expert_shapes

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ShardWriter", "quantize_folder"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"


class ShardWriter:
    """Collects tensors into shards of at most ``max_bytes`` (a larger tensor gets a shard of its own) and writes each
    as it fills; :meth:`finish` names them ``model-0000i-of-0000n.safetensors`` and writes the index. A checkpoint the
    folder held before is removed first."""

    def __init__(self, folder: Path, max_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.folder, self.max_bytes = Path(folder), max_bytes
        clear_checkpoint(self.folder)  # an earlier checkpoint's index would win over the shards written here
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.folder / f"shard-{len(self.shards):05d}.safetensors.part"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        if self.pending or not self.shards:
            self._flush()
        count = len(self.shards)
        names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        for (path, _), name in zip(self.shards, names, strict=True):
            path.rename(self.folder / name)
        if count > 1:
            weight_map = {t: name for (_, tensors), name in zip(self.shards, names, strict=True) for t in tensors}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        return [self.folder / n for n in names]


def _meta_model(config) -> tuple[nn.Module, dict[str, nn.Linear], dict[str, str]]:
    """The model built on the meta device (no memory, no weights), its ``nn.Linear`` layers by name, and its tied
    parameters (alias -> the name checkpoints store)."""
    model = hf_meta_model(config)
    tied = {alias: names[0] for names in set(tied_groups(model).values()) for alias in names[1:]}
    return model, {name: m for name, m in model.named_modules() if type(m) is nn.Linear}, tied


def _experts_targets(
    model: nn.Module, source: TensorSource, stored: dict[str, dict[str, list[str]]], skip, reports: list[LayerReport]
) -> dict:
    """The per-expert tensors to quantize of each experts module of the meta model (3-D ``gate_up_proj`` /
    ``down_proj``), under the names the folder stores them under (``stored``: :func:`stored_expert_names`) -> its
    shape; each module's report (or why it stays as stored) appended to ``reports``."""
    targets = {}
    for name, module in experts_modules(model):
        reason = "matches skip" if matches_skip(name, skip) else experts_unfit_reason(module)
        names = stored.get(name)
        if not reason and (names is None or names["gate_proj"][0] not in source):
            reason = "the checkpoint stores these experts stacked, not per expert"
        if reason:
            reports.append(LayerReport(name, False, None, None, reason, kind="experts"))
            continue
        shapes = per_expert_shapes(module)
        reports.append(LayerReport(name, True, "emulation", "w8a16", "", kind="experts"))
        targets.update({n: shapes[p] for p, ns in names.items() for n in ns})
    return targets


def quantize_folder(
    src: Path,
    out: Path,
    *,
    scheme: str = "MXFP8",
    scale_mode: ScaleMode = "floor",
    skip: tuple[str, ...] = ("lm_head",),
    device: str | torch.device = "cpu",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[int, int], None] | None = None,
    skip_must_match: bool = False,
) -> QuantizeReport:
    """Write the MXFP8 checkpoint of the model folder ``src`` into the existing folder ``out`` (its safetensors
    shards, index and ``config.json``; no other files). ``device``: where weights are quantized (the bytes are the
    same on any device). ``progress``: called with the bytes of each source tensor once it is written and the bytes
    of them all. ``skip_must_match``: a ``skip`` pattern that matches no linear layer or experts module is an error
    (before anything is written). An already-quantized source is refused."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src, local_files_only=True)
    if getattr(config, "quantization_config", None):
        raise CheckpointError(
            f"{src} is already quantized ({_describe_quantization(config)}); give an unquantized model"
        )
    model, layers, tied = _meta_model(config)
    routers = router_names(model)
    source = TensorSource(src)
    experts = stored_expert_names(model)  # where the folder stores each experts module's per-expert tensors
    own = stored_to_model_names(model, experts)  # the source's names, as stored, -> the model's
    stored = {m: s for s, m in own.items()}
    reports, targets = [], {}  # targets: tensor name, as stored -> the shape the config gives it
    for name, module in layers.items():
        tied_to = tied.get(f"{name}.weight")
        reason = f"tied to {tied_to}" if tied_to else skip_reason(name, module, skip, routers)
        if reason:
            reports.append(LayerReport(name, False, None, None, reason))
        else:
            reports.append(LayerReport(name, True, "emulation", "w8a16", ""))
            targets[stored.get(f"{name}.weight", f"{name}.weight")] = (module.out_features, module.in_features)
    targets.update(_experts_targets(model, source, experts, skip, reports))
    unmatched = [p for p in skip if not any(matches_skip(r.name, (p,)) for r in reports)] if skip_must_match else []
    if unmatched:
        raise CheckpointError(f"skip pattern {unmatched[0]!r} matches no linear layer or experts module of {src}")
    for name in targets:  # before anything is written
        if name in source and source.dtypes[name] not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(
                f"{name} is stored as {source.dtypes[name]}; mxgemm quantizes float32, bfloat16 or float16 weights "
                "(save the model in one of them first)"
            )
    writer, quantized = ShardWriter(out, max_shard_bytes), set()
    total = sum(math.prod(source.shapes[n]) * (source.dtypes[n] or torch.float32).itemsize for n in source.where)
    for name in source.where:
        tensor = source.load(name)
        nbytes = tensor.numel() * tensor.element_size()
        if name in targets:
            if tuple(tensor.shape) != targets[name]:
                raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}; the config's is {list(targets[name])}")

            t = quantize(tensor.to(device), scale_mode=scale_mode)
            writer.add(name, t.qdata.cpu())
            writer.add(f"{name}_scale", t.scale.cpu())
            del targets[name]
            quantized.add(name)
        else:
            writer.add(name, tensor)
        del tensor
        if progress is not None:
            progress(nbytes, total)
    if targets:
        raise CheckpointError(f"{src}: no tensor for {sorted(targets)[0]} (and {len(targets) - 1} more)")
    writer.finish()
    cfg = config.to_dict()
    kept = {own.get(n, n): source.shapes[n] for n in source.where if n not in quantized}  # routers, experts, ...
    owners = list(dict.fromkeys([r.name for r in reports if not r.replaced] + unquantized_owners(model, kept)))
    ignore = dict.fromkeys(stored_module_names(model, owners).values())  # as the checkpoint names them
    cfg["quantization_config"] = compressed_tensors_config(scheme, list(ignore))
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    return QuantizeReport(tuple(reports))


def _describe_quantization(config) -> str:
    q = config.quantization_config
    q = q if isinstance(q, dict) else getattr(q, "to_dict", lambda: {})()
    return str(q.get("quant_method") or q.get("format") or q.get("quant_algo") or "quantization_config present")
