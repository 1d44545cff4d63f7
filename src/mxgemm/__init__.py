"""mxgemm: MXFP8 dense GEMMs and linear layers for PyTorch, on the fastest correct backend of the GPU in hand."""

from __future__ import annotations

from .backends import AUTO_PRIORITY, RECIPES, Availability, Backend, PreparedWeight
from .checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from .device import DeviceInfo, describe_device
from .errors import BackendUnavailableError, MXGemmError, UnknownBackendError
from .format import BLOCK_SIZE, MXTensor, dequantize, quantize
from .fusion import fuse, fuse_shared_inputs
from .gated import fuse_gated_mlps
from .grouped import PreparedGroupedWeight, grouped_linear, prepare_grouped_weight
from .linear import MXFP8Linear
from .models import QuantizeReport, quantize_model
from .moe import MXFP8Experts, moe_experts
from .resolve import BackendStatus, available_backends, explain_auto, resolve_backend
from .version import __version__
from .weights import linear, prepare_weight

__all__ = [
    "AUTO_PRIORITY",
    "BLOCK_SIZE",
    "RECIPES",
    "Availability",
    "Backend",
    "BackendStatus",
    "BackendUnavailableError",
    "CheckpointError",
    "DeviceInfo",
    "MXFP8Experts",
    "MXFP8Linear",
    "MXGemmError",
    "MXTensor",
    "PreparedGroupedWeight",
    "PreparedWeight",
    "QuantizeReport",
    "UnknownBackendError",
    "__version__",
    "available_backends",
    "dequantize",
    "describe_device",
    "explain_auto",
    "fuse",
    "fuse_gated_mlps",
    "fuse_shared_inputs",
    "grouped_linear",
    "linear",
    "load_checkpoint",
    "moe_experts",
    "prepare_grouped_weight",
    "prepare_weight",
    "quantize",
    "quantize_model",
    "resolve_backend",
    "save_checkpoint",
]
