"""The hand-written CUDA kernel for small M (``csrc/small_m.cu``): built with nvcc on first use, loaded with ctypes.

It runs the ``hybrid_sm90`` weight (FP8 E4M3 ``[Np, Kp]`` with fp32 128x128 block scales) against bf16 activations
for M <= 16 on ``mma.sync`` tensor cores, streaming the weight through shared memory with ``cp.async`` and decoding
it in registers; exact with respect to that weight for ``|x| < 2^64``. It needs SM90 (thread-block clusters sum the
K splits). The library is compiled once per source, nvcc version and GPU architecture into
``$MXGEMM_CACHE_DIR/kernels`` (about 10 s, ``kernels/nvcc.py``); nothing is built or loaded at import time.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..availability import Availability
from ..recipes import SMALL_M_MAX
from . import SMALL_M, Launch, LaunchEntry, address, check_bf16_bias, free_with, nvcc, raw_stream, shaped_as

logger = logging.getLogger("mxgemm")

__all__ = [
    "MAX_M",
    "SmallMConfig",
    "accepts",
    "library",
    "linear_plan",
    "small_m_linear",
    "small_m_status",
]

MAX_M = SMALL_M_MAX  # the kernel's limit (two 8-token MMA tiles), which the hybrid recipe's crossover follows
_SOURCE = Path(__file__).parent / "csrc" / "small_m.cu"
_ROWS_PER_CTA_TILE = 16
_K_PER_CTA = 512  # 4 warps x 128


@functools.cache
def library(capability: tuple[int, int]) -> ctypes.CDLL:
    """Build (once, cached on disk) and load the kernel library for a GPU architecture. Raises RuntimeError with
    nvcc's message when it cannot be built."""
    lib = nvcc.build(_SOURCE, capability, symbols=("mxgemm_small_m", "mxgemm_small_m_run", "mxgemm_small_m_plan_free"))
    p, i = ctypes.c_void_p, ctypes.c_int
    # W, S, s_stride, X, bias, Y, ldy, M, K, N, Np, Kp, rt, splits, stages, stream
    lib.mxgemm_small_m.argtypes = [p, p, i, p, p, p, *[i] * 9, p]
    lib.mxgemm_small_m_run.argtypes = [p, p, p, p, p]  # plan, X, bias, Y, stream
    lib.mxgemm_small_m.restype = lib.mxgemm_small_m_run.restype = i
    lib.mxgemm_small_m_plan_free.argtypes, lib.mxgemm_small_m_plan_free.restype = [p], None
    return lib


class _Plan(ctypes.Structure):
    """``SmallMPlan`` of csrc/small_m.cu: a call's fixed arguments."""

    _fields_ = (
        [("W", ctypes.c_void_p), ("S", ctypes.c_void_p)]
        + [(name, ctypes.c_int) for name in ("s_stride", "M", "K", "N", "Np", "Kp", "rt", "splits", "stages")]
        + [("graph", ctypes.c_void_p), ("graphed", ctypes.c_int), ("reserved", ctypes.c_int)]
    )


@functools.cache
def small_m_status(capability: tuple[int, int] | None) -> Availability:
    """Whether the kernel is built and loaded for this architecture (built here on first call); the reason if not."""
    if capability is None or capability < (9, 0):
        return Availability(False, "the small-M CUDA kernel needs a GPU of SM90+ (thread-block clusters)")
    try:
        library(capability)
    except (RuntimeError, OSError) as exc:
        reason = f"small-M CUDA kernel unavailable: {exc}"
        logger.info("mxgemm: %s; the Triton kernel runs M <= 16 instead", reason)
        return Availability(False, reason)
    return Availability(True, f"small-M CUDA kernel built for sm_{capability[0]}{capability[1]}")


@dataclass(frozen=True)
class SmallMConfig:
    """``rt`` 16-row tiles per CTA (1, 2), ``splits`` K splits summed in one thread-block cluster (1-8), ``stages``
    depth of the shared-memory ring (2, 3)."""

    rt: int = 1
    splits: int = 1
    stages: int = 2

    def valid(self, n_padded: int, k_padded: int) -> bool:
        """Whether it tiles a ``[n_padded, k_padded]`` weight: whole row tiles, whole 512-deep CTA slices a split."""
        return (
            self.rt in (1, 2)
            and self.splits in range(1, 9)
            and self.stages in (2, 3)
            and n_padded % (_ROWS_PER_CTA_TILE * self.rt) == 0
            and k_padded % (_K_PER_CTA * self.splits) == 0
        )


def accepts(x: torch.Tensor) -> bool:
    """Whether the kernel can take these activations: bf16, at most MAX_M rows, contiguous, 16-byte aligned."""
    return x.dtype == torch.bfloat16 and x.shape[0] <= MAX_M and _aligned_rows(x)


def _aligned_rows(x: torch.Tensor) -> bool:
    return x.is_contiguous() and x.data_ptr() % 16 == 0


def linear_plan(
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    k: int,
    m: int,
    config: SmallMConfig,
    graphed: bool = True,
) -> Launch:
    """The :class:`~mxgemm.kernels.Launch` ``(x, bias) -> y`` for M rows (M <= 16): ``x`` bf16 [M, k], or [..., k] whose
    leading dimensions hold M rows (copied first where strided or misaligned), ``bias`` contiguous bf16 [n] or None,
    ``y`` bf16 [M, n] (or [..., n]); ``qdata`` uint8/e4m3 [Np, Kp], ``block_scale`` fp32 [>= Np/128, Kp/128]. One ctypes
    call per launch, its arguments but the call's pointers computed here, once. ``graphed``: outside stream capture, the
    kernel launches as a CUDA graph of the plan's (made on the first such call), its arguments set per call, which costs
    less host time than a launch (``csrc/graph_launch.cuh``). Its ``entry``: the plan as C++ calls it."""
    np_, kp = qdata.shape
    if not 1 <= m <= MAX_M or not config.valid(np_, kp):
        raise ValueError(f"the small-M kernel cannot run M={m} with config {config} on a [{np_}, {kp}] weight")
    device = qdata.device
    lib = library(torch.cuda.get_device_capability(device))
    fn = lib.mxgemm_small_m_run
    plan = _Plan(
        qdata.data_ptr(),
        block_scale.data_ptr(),
        block_scale.stride(0),
        m,
        k,
        n,
        np_,
        kp,
        config.rt,
        config.splits,
        config.stages,
        None,
        int(graphed),
    )
    plan_address = ctypes.addressof(plan)
    index = device.index

    def launch(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not _aligned_rows(x):  # strided or misaligned: a copy the kernel takes
            x = x.clone(memory_format=torch.contiguous_format)
        y = torch.empty(m, n, dtype=torch.bfloat16, device=device)  # integer sizes: less host time than a tuple
        err = fn(plan_address, x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), raw_stream(index))
        if err:
            raise RuntimeError(f"mxgemm small-M kernel failed to launch (cudaError {err}) for M={m} config {config}")
        return y if x.dim() == 2 else shaped_as(y, x, m, n)

    planned = Launch(launch, entry=LaunchEntry(SMALL_M, address(fn), plan_address, m, n), keep=plan)
    free_with(planned, lib.mxgemm_small_m_plan_free, [plan])
    return planned


def small_m_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    config: SmallMConfig,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` bf16 [M, K] (M <= 16, contiguous, K % 16 == 0), ``qdata`` uint8/e4m3 [Np, Kp], ``block_scale`` fp32
    [>= Np/128, Kp/128] (+ a contiguous bf16 ``bias`` [n]) -> bf16 [M, n]."""
    if not accepts(x):
        raise ValueError(f"the small-M kernel takes contiguous 16-byte-aligned bf16 x of <= {MAX_M} rows")
    check_bf16_bias(bias, n)
    return linear_plan(qdata, block_scale, n, x.shape[1], x.shape[0], config)(x, bias)
