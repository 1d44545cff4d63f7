"""vLLM: mxgemm as the kernel of vLLM's MXFP8 linear layers (compressed-tensors ``mxfp8-quantized`` and ModelOpt MXFP8
checkpoints), through vLLM's plugin entry point ``vllm.general_plugins`` (``pip install 'mxgemm[vllm]'``).

vLLM's MXFP8 schemes create each layer's ``weight`` (float8_e4m3fn [N, K], this rank's shard) and ``weight_scale``
(uint8 E8M0 [N, K/32]), load them, then hand the layer to the kernel it picked from its registry:
:class:`MxgemmMxfp8LinearKernel` prepares the weight once, in ``process_weights_after_loading``, on the backend mxgemm
resolves for the device (``hybrid_sm90`` on Hopper; ``MXGEMM_BACKEND`` or the ``backend`` class attribute pick
another), drops the checkpoint tensors where the backend keeps its own copy (one copy on the device), and runs
``mxgemm.linear`` in ``apply_weights`` (one ``mxgemm::linear`` op under vLLM's ``torch.compile``). Tensor-parallel
shards are whole MX tensors of their own: any N, and any K shard that is a multiple of 32.

:func:`register` (the entry point) adds the kernel with vLLM's ``register_linear_kernel`` for the CPU and CUDA
platforms and moves it first in vLLM's MXFP8 list, ahead of vLLM's own kernels (on CUDA these include a bf16
emulation that always accepts), so that vLLM uses mxgemm wherever mxgemm's backends can run.
"""

from __future__ import annotations

import logging

import torch

from ..errors import MXGemmError
from ..format import BLOCK_SIZE
from ..resolve import resolve_backend
from ..weights import linear, prepare_weight
from . import vllm_log

__all__ = ["register"]  # and MxgemmMxfp8LinearKernel, built on first access (it subclasses vLLM's interface)

logger = logging.getLogger("mxgemm")


_PLATFORMS = ("CPU", "CUDA")


def _kernel_class():
    from vllm.model_executor.kernels.linear.mxfp8 import Mxfp8LinearKernel, Mxfp8LinearLayerConfig

    class MxgemmMxfp8LinearKernel(Mxfp8LinearKernel):
        """vLLM's MXFP8 linear kernel interface on mxgemm (see the module docstring)."""

        backend: str | None = None  # None: MXGEMM_BACKEND, else auto

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            try:
                resolve_backend(cls.backend)
            except MXGemmError as exc:  # the resolver's own reason, for vLLM's list of failures
                return False, f"mxgemm: {exc}"
            return True, None

        @classmethod
        def can_implement(cls, c: Mxfp8LinearLayerConfig) -> tuple[bool, str | None]:
            if c.bmm_batch_size is not None:
                return False, "mxgemm runs 2-D MXFP8 linear layers, not batched matmuls"
            k = c.weight_shape[1]
            if k % BLOCK_SIZE:
                reason = f"mxgemm needs K (this shard's in_features) a multiple of {BLOCK_SIZE}"
                vllm_log.left(f"MXFP8 linear layers whose K is not a multiple of {BLOCK_SIZE} on vLLM's own kernels")
                return False, f"{reason}, got {k}"
            return True, None

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            vllm_log.taken("linear")  # one kernel a layer, made as vLLM builds the model

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            weight, scale = layer.weight.data, layer.weight_scale.data
            n, k = weight.shape
            prepared = prepare_weight(weight, scale[:n, : k // BLOCK_SIZE], backend=self.backend)
            layer.mxgemm_weight = prepared
            kept = {t.untyped_storage().data_ptr() for t in prepared.tensors.values()}
            if weight.untyped_storage().data_ptr() not in kept:  # the backend made its own copy: drop the checkpoint's
                del layer.weight, layer.weight_scale
            logger.debug("vLLM MXFP8 layer [%d, %d] on %s (%s)", n, k, prepared.backend, prepared.recipe)
            vllm_log.prepared("linear", prepared.backend, prepared.recipe)

        def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
            return linear(x, layer.mxgemm_weight, bias)

    return MxgemmMxfp8LinearKernel


def __getattr__(name: str):
    if name == "MxgemmMxfp8LinearKernel":  # built on first use: it subclasses vLLM's interface
        cls = _kernel_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: register mxgemm's quantization config for MXFP8 experts
    (:mod:`mxgemm.integrations.vllm_moe`) and put mxgemm's kernel first in vLLM's MXFP8 kernel list of the CPU and
    CUDA platforms (once; vLLM calls plugins in every process it starts)."""
    from vllm.model_executor.kernels import linear as registry
    from vllm.platforms import PlatformEnum

    from . import vllm_moe

    vllm_moe.register()
    kernel = __getattr__("MxgemmMxfp8LinearKernel")
    for name in _PLATFORMS:
        platform = PlatformEnum[name]
        kernels = registry._POSSIBLE_MXFP8_KERNELS.get(platform, [])
        if kernel in kernels:
            continue
        registry.register_linear_kernel(kernel, platform, kernel_type="mxfp8")
        kernels = registry._POSSIBLE_MXFP8_KERNELS[platform]
        kernels.insert(0, kernels.pop(kernels.index(kernel)))  # ahead of vLLM's own (the registry appends)
