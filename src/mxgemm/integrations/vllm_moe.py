"""vLLM: the experts of MXFP8 mixture-of-experts checkpoints (compressed-tensors ``mxfp8-quantized``, ModelOpt
MXFP8) on mxgemm's grouped kernels, through vLLM's public extension points; :func:`register` is called by the
plugin's entry point.

- Quantization configs registered as ``"mxgemm"`` and ``"mxgemm_modelopt"`` (``register_quantization_config``)
  claim, through their ``override_quantization_method``, the compressed-tensors and ModelOpt MXFP8 checkpoints of a
  model with experts, where mxgemm's grouped backend resolves on this machine (:func:`grouped_reason`); elsewhere
  vLLM's own MXFP8 path runs them and vLLM's log says why. Each is the format's own config for everything but the
  experts: the linear layers keep vLLM's MXFP8 scheme (whose kernel is mxgemm's, :mod:`.vllm_plugin`).
- Their MoE method creates vLLM's canonical ``w13_weight`` / ``w2_weight`` and their ``_scale`` parameters with
  vLLM's loader attributes (compressed-tensors' own ``create_weights``), so that vLLM's loader stacks the per-expert
  tensors and shards them for tensor and expert parallelism; once loaded it prepares each as one grouped weight
  (:func:`mxgemm.prepare_grouped_weight`) and runs :func:`mxgemm.moe_experts` on the router's choice, experts of
  other ranks (``expert_map`` -1) adding nothing. vLLM reduces the partial sums across ranks and runs shared experts.
"""

from __future__ import annotations

from ..device import DeviceInfo
from ..errors import MXGemmError
from ..format import MXFP8
from ..grouped import prepare_grouped_weight
from ..moe import experts_stay_in_bf16, moe_experts
from ..resolve import resolve_backend
from . import vllm_log

# and _CLASSES, built on first access
__all__ = ["METHOD", "MODELOPT_METHOD", "experts_layer_reason", "grouped_reason", "register"]

METHOD = "mxgemm"  # compressed-tensors checkpoints
MODELOPT_METHOD = "mxgemm_modelopt"  # ModelOpt MXFP8 checkpoints
_CLASSES = ("MxgemmConfig", "MxgemmModelOptConfig", "MxgemmMxfp8MoEMethod")


def _device() -> DeviceInfo:
    """This machine's GPU as vLLM's platform describes it (NVML: the engine's process makes no CUDA context before
    vLLM starts its workers), or the CPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return DeviceInfo(type="cpu")
    capability = current_platform.get_device_capability()
    return DeviceInfo("cuda", current_platform.get_device_name(), (capability.major, capability.minor))


def grouped_reason(backend: str | None = None, device: DeviceInfo | None = None) -> str:
    """Why mxgemm does not run MXFP8 experts on ``device`` (None: this machine's) under ``backend`` (None:
    ``$MXGEMM_BACKEND``, else ``auto``), or "" where it does: a named backend without grouped weights, or ``auto`` on
    a GPU where only the emulation runs them (vLLM's own MXFP8 path is faster there)."""
    device = device or _device()
    try:
        resolve_backend(backend, device=device, grouped=True)
    except MXGemmError as exc:
        return str(exc)
    return experts_stay_in_bf16(device, backend, None)


def _claim(method: str, is_mxfp8: bool, user_quant, hf_config, backend: str | None) -> str | None:
    """``method`` where a checkpoint of MXFP8 format (``is_mxfp8``) quantizes a model with experts that mxgemm's
    grouped backend runs here, unless the user asked for another method; else None (vLLM's own path), the reason
    said once in vLLM's log where it is this machine."""
    if user_quant not in (None, method) or not is_mxfp8 or (hf_config is not None and not _has_experts(hf_config)):
        return None
    reason = grouped_reason(backend)
    if reason:
        vllm_log.left(f"MoE experts on vLLM's own MXFP8 path ({reason})")
        vllm_log.say_once(f"mxgemm: MoE experts run on vLLM's own MXFP8 path ({reason})")
        return None
    return method


def _has_experts(hf_config) -> bool:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return any(getattr(text, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def experts_layer_reason(moe) -> str:
    """What of a vLLM MoE layer of config ``moe`` (vLLM's ``FusedMoEConfig``) mxgemm's experts do not compute, or "":
    they run silu(gate) * up between the projections, without biases, clamps or adapters."""
    if moe.activation.value != "silu" or not moe.is_act_and_mul:
        return f"activation is {moe.activation.value}"
    for field in ("swiglu_limit", "swiglu_alpha", "swiglu_beta"):  # vLLM's clamped and scaled SwiGLU
        if getattr(moe, field, None) is not None:
            return f"SwiGLU has {field} {getattr(moe, field)}"
    if getattr(moe, "has_bias", False):
        return "experts have biases"
    if getattr(moe, "is_lora_enabled", False):
        return "experts have LoRA adapters"
    return ""


def _runs(layer) -> bool:
    """Whether mxgemm's MoE method takes vLLM's MoE ``layer``; where it does not, vLLM's own MXFP8 path does, and
    the line of what runs where says why."""
    reason = experts_layer_reason(layer.moe_config)
    if not reason and getattr(layer, "apply_router_weight_on_input", False):  # Llama 4's
        reason = "router weights apply to the experts' inputs"
    if reason:
        vllm_log.left(f"MoE layers whose {reason} on vLLM's own MXFP8 path")
    return not reason


def _classes():
    """mxgemm's configs and MoE method by name (:data:`_CLASSES`), built on first use: they subclass vLLM's."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe import (  # noqa: E501
        CompressedTensorsMoEMethod,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_mxfp8 import (  # noqa: E501
        CompressedTensorsW8A8Mxfp8MoEMethod,
    )
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMxFp8Config

    class MxgemmMxfp8MoEMethod(CompressedTensorsW8A8Mxfp8MoEMethod):
        """vLLM's compressed-tensors MXFP8 MoE method with its weights prepared for, and run on, mxgemm (see the
        module docstring)."""

        backend: str | None = None  # None: MXGEMM_BACKEND, else auto

        def __init__(self, moe):
            CompressedTensorsMoEMethod.__init__(self, moe)  # not vLLM's kernel selection: mxgemm runs these experts
            reason = experts_layer_reason(moe)
            if reason:
                raise MXGemmError(f"mxgemm runs experts of silu(gate) * up; this layer's {reason}")
            vllm_log.taken("MoE")  # one method a layer, made as vLLM builds the model

        # create_weights: compressed-tensors' own (the canonical names and vLLM's loader attributes)

        def process_weights_after_loading(self, layer) -> None:
            for name in ("w13", "w2"):
                weight, scale = getattr(layer, f"{name}_weight"), getattr(layer, f"{name}_weight_scale")
                prepared = prepare_grouped_weight(weight.data, scale.data, backend=self.backend)
                setattr(layer, f"mxgemm_{name}", prepared)
                kept = {t.untyped_storage().data_ptr() for t in prepared.tensors.values()}
                if weight.data.untyped_storage().data_ptr() not in kept:  # the backend keeps its own copy
                    delattr(layer, f"{name}_weight")
                    delattr(layer, f"{name}_weight_scale")
            vllm_log.prepared("MoE", prepared.backend, prepared.recipe)

        def get_fused_moe_quant_config(self, layer):
            return None  # no vLLM kernel reads these experts

        def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
            if layer.apply_router_weight_on_input:
                raise MXGemmError("mxgemm weights the experts' outputs; this layer weights their inputs")
            ids = topk_ids  # global expert ids -> this rank's, -1 (adding nothing) for the others' experts
            if layer.expert_map is not None:
                ids = layer.expert_map[topk_ids.long()]
            return moe_experts(x, ids, topk_weights, layer.mxgemm_w13, layer.mxgemm_w2)

    class MxgemmConfig(CompressedTensorsConfig):
        """compressed-tensors' config with the experts on mxgemm (see the module docstring)."""

        def get_name(self):
            return METHOD

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
            config = hf_quant_cfg if isinstance(hf_quant_cfg, dict) else {}
            is_mxfp8 = config.get("quant_method") == "compressed-tensors"
            is_mxfp8 = is_mxfp8 and config.get("format") == MXFP8.compressed_tensors
            return _claim(METHOD, is_mxfp8, user_quant, hf_config, MxgemmMxfp8MoEMethod.backend)

        def get_quant_method(self, layer, prefix):
            if isinstance(layer, RoutedExperts):
                # as vLLM's compressed-tensors MoE path does first: the "Linear" targets also name the experts
                self._add_fused_moe_to_target_scheme_map()
                scheme = self.get_scheme_dict(layer, f"{prefix}.0.{layer.ckpt_gate_proj_name}")
                weights = scheme.get("weights") if scheme else None
                if weights is not None and self._is_mxfp8(weights) and _runs(layer):
                    return MxgemmMxfp8MoEMethod(layer.moe_config)
            return super().get_quant_method(layer, prefix)

    class MxgemmModelOptConfig(ModelOptMxFp8Config):
        """ModelOpt's MXFP8 config with the experts on mxgemm (see the module docstring)."""

        def get_name(self):
            return MODELOPT_METHOD

        @classmethod
        def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
            algo = cls._extract_modelopt_quant_algo(hf_quant_cfg) if isinstance(hf_quant_cfg, dict) else None
            is_mxfp8 = algo is not None and MXFP8.modelopt in algo
            return _claim(MODELOPT_METHOD, is_mxfp8, user_quant, hf_config, MxgemmMxfp8MoEMethod.backend)

        def get_quant_method(self, layer, prefix):
            if isinstance(layer, RoutedExperts) and not self.is_layer_excluded(prefix) and _runs(layer):
                return MxgemmMxfp8MoEMethod(layer.moe_config)
            return super().get_quant_method(layer, prefix)

    classes = {
        "MxgemmConfig": MxgemmConfig,
        "MxgemmModelOptConfig": MxgemmModelOptConfig,
        "MxgemmMxfp8MoEMethod": MxgemmMxfp8MoEMethod,
    }
    for name, cls in classes.items():  # found by name where vLLM unpickles the config in its workers
        cls.__qualname__ = name
    return classes


def __getattr__(name: str):
    if name in _CLASSES:  # built once, on first use: they subclass vLLM's
        if name not in globals():
            globals().update(_classes())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register mxgemm's quantization configs with vLLM (once per process)."""
    from vllm.model_executor.layers.quantization import get_quantization_config, register_quantization_config

    for method, name in ((METHOD, "MxgemmConfig"), (MODELOPT_METHOD, "MxgemmModelOptConfig")):
        config = __getattr__(name)
        try:
            registered = get_quantization_config(method)
        except ValueError:
            registered = None
        if registered is not config:
            register_quantization_config(method)(config)
