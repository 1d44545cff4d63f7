"""The grouped FP8 GEMM for many rows per expert on Hopper (``csrc/grouped_fp8.cu``, sm_90a: TMA loads, ``wgmma``):
rows sorted by expert, quantized per 1x128 apart (:mod:`mxgemm.kernels.grouped.quant`), times each expert's E4M3
weight with fp32 128x128 block scales; tokens as wgmma's M, 64 or 128 rows by 64 or 128 weight rows per tile, a CTA
per tile or as many CTAs as fit on the GPU taking tiles in turn, each finding its tiles' experts from the offsets on
the device. Built with nvcc on first use (``kernels/nvcc.py``), loaded with ctypes; which config runs is the
backend's choice."""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ...availability import Availability
from .. import nvcc, raw_stream
from .fp8 import token_tile_slots

logger = logging.getLogger("mxgemm")

__all__ = ["WgmmaConfig", "grouped_wgmma", "library", "wgmma_status"]

_SOURCE = Path(__file__).parent / "csrc" / "grouped_fp8.cu"
_HEADERS = Path(__file__).parents[1] / "csrc"  # sm90.cuh, the device helpers it shares with the dense kernels
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
# W, S, s_expert, s_stride, XQ, XS, ld_xs, x_rows, offsets, dst, Y, ldy, y_fp16, rows, E, N, K, tn, wn, stages,
# slots, persistent, stream
_ARGS = [_P, _P, _L, _I, _P, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P]


@functools.cache
def library(capability: tuple[int, int]) -> ctypes.CDLL:
    """Build (once, cached on disk) and load the kernel for sm_90a. Raises RuntimeError when it cannot be built."""
    lib = nvcc.build(_SOURCE, capability, suffix="a", symbols=("mxgemm_grouped_fp8",), include_dirs=(_HEADERS,))
    lib.mxgemm_grouped_fp8.argtypes, lib.mxgemm_grouped_fp8.restype = _ARGS, _I
    return lib


@functools.cache
def wgmma_status(capability: tuple[int, int] | None) -> Availability:
    """Whether the kernel is built and loaded here (built on first call); the reason if not."""
    if capability != (9, 0):
        return Availability(False, "the grouped wgmma kernel is built for SM90 (sm_90a) only")
    try:
        library(capability)
    except (RuntimeError, OSError) as exc:
        logger.info("mxgemm: grouped wgmma kernel unavailable: %s", exc)
        return Availability(False, f"grouped wgmma kernel unavailable: {exc}")
    return Availability(True, "grouped wgmma kernel built for sm_90a")


@dataclass(frozen=True)
class WgmmaConfig:
    """A launch of the kernel: ``tn`` rows of one expert by ``wn`` weight rows per CTA, a TMA ring of ``stages``;
    ``persistent``: as many CTAs as fit on the GPU at once, each taking tiles in turn (its next tile's loads overlap
    its last one's stores), instead of a CTA per tile."""

    tn: int = 128
    wn: int = 128
    stages: int = 4
    persistent: bool = False

    def valid(self) -> bool:
        """``tn`` and ``wn`` 64 or 128; 2, 4 or 6 stages."""
        return self.tn in (64, 128) and self.wn in (64, 128) and self.stages in (2, 4, 6)


def grouped_wgmma(
    xq: torch.Tensor,
    xs: torch.Tensor,
    rows: int,
    w_bytes: torch.Tensor,
    block_scale: torch.Tensor,
    offsets: torch.Tensor,
    n: int,
    out_dtype: torch.dtype,
    config: WgmmaConfig,
    dst: torch.Tensor | None = None,
) -> torch.Tensor:
    """``xq`` uint8 ``[>= rows, Kp]`` and ``xs`` fp32 ``[Kp / 128, Sp]`` (:func:`quantize_rows`' layout): ``rows``
    rows sorted by expert; ``w_bytes`` uint8 ``[E, n, K]`` contiguous; ``block_scale`` fp32 ``[E, >= ceil(n/128),
    >= ceil(K/128)]`` of unit stride along K; ``offsets`` int32 ``[E]`` -> [rows, n] in ``out_dtype`` (bf16, fp16),
    row ``i`` written to row ``dst[i]`` where ``dst`` (int32 [rows], a permutation) is given."""
    if not config.valid():
        raise ValueError(f"the grouped wgmma kernel cannot run {config}")
    e, _, k = w_bytes.shape
    ok = (
        w_bytes.is_contiguous()
        and block_scale.dtype == torch.float32
        and block_scale.stride(2) == 1
        and offsets.dtype == torch.int32
        and xq.is_contiguous()
        and xq.shape[1] == -(-k // 128) * 128
        and xs.is_contiguous()
        and xs.shape[0] == xq.shape[1] // 128
        and xs.shape[1] % 4 == 0
        and out_dtype in (torch.bfloat16, torch.float16)
    )
    if not ok:
        raise ValueError("the grouped wgmma kernel reads quantize_rows' layout, contiguous weights, int32 offsets")
    y = torch.empty((rows, n), dtype=out_dtype, device=xq.device)
    if rows == 0 or n == 0:
        return y
    err = library(torch.cuda.get_device_capability(xq.device)).mxgemm_grouped_fp8(
        w_bytes.data_ptr(),
        block_scale.data_ptr(),
        block_scale.stride(0),
        block_scale.stride(1),
        xq.data_ptr(),
        xs.data_ptr(),
        xs.shape[1],
        xq.shape[0],
        offsets.data_ptr(),
        None if dst is None else dst.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        int(out_dtype == torch.float16),
        rows,
        e,
        n,
        k,
        config.tn,
        config.wn,
        config.stages,
        token_tile_slots(rows, e, config.tn),
        int(config.persistent),
        raw_stream(xq.device.index),
    )
    if err:
        raise RuntimeError(f"mxgemm grouped wgmma kernel failed: CUDA error {err}")
    return y
