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

__all__ = ["ExpertsLaunch", "WgmmaConfig", "grouped_wgmma", "library", "wgmma_status"]

_SOURCE = Path(__file__).parent / "csrc" / "grouped_fp8.cu"
_HEADERS = Path(__file__).parents[1] / "csrc"  # sm90.cuh, the device helpers it shares with the dense kernels
_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
# W, S, s_expert, s_stride, XQ, XS, ld_xs, x_rows, offsets, dst, Y, ldy, y_fp16, rows, E, N, K, tn, wn, stages,
# slots, persistent, stream
_ARGS = [_P, _P, _L, _I, _P, _P, _I, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _I, _P]
# X, ids, ids_64, weights, W1, S1, s1_expert, s1_stride, W2, S2, s2_expert, s2_stride, ws, out, T, k, E, H, I, fp16,
# tn1, wn1, stages1, persistent1, tn2, wn2, stages2, persistent2, stream
_MOE_ARGS = [_P, _P, _I, _P, _P, _P, _L, _I, _P, _P, _L, _I, _P, _P, _L, *[_I] * 13, _P]


@functools.cache
def library(capability: tuple[int, int]) -> ctypes.CDLL:
    """Build (once, cached on disk) and load the kernel for sm_90a. Raises RuntimeError when it cannot be built."""
    return build(_SOURCE, capability)


def build(source: Path, capability: tuple[int, int]) -> ctypes.CDLL:
    """``source`` (the package's ``grouped_fp8.cu`` or a copy of it) built for sm_90a with the package's headers
    (cached on disk) and loaded, its entry points typed. Raises RuntimeError when it cannot be built."""
    symbols = ("mxgemm_grouped_fp8", "mxgemm_moe_experts", "mxgemm_moe_workspace", "mxgemm_token_tile_slots")
    lib = nvcc.build(source, capability, suffix="a", symbols=symbols, include_dirs=(_HEADERS,))
    lib.mxgemm_grouped_fp8.argtypes, lib.mxgemm_grouped_fp8.restype = _ARGS, _I
    lib.mxgemm_moe_experts.argtypes, lib.mxgemm_moe_experts.restype = _MOE_ARGS, _I
    lib.mxgemm_moe_workspace.argtypes, lib.mxgemm_moe_workspace.restype = [_L, _I, _I, _I, _I, _I], _L
    lib.mxgemm_token_tile_slots.argtypes, lib.mxgemm_token_tile_slots.restype = [_L, _I, _I], _I
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


@dataclass(frozen=True)
class ExpertsLaunch:
    """The routed block of a mixture of experts for one shape in one C call (``mxgemm_moe_experts``: the copies sorted
    by expert, gathered and quantized, gate/up, ``silu(gate) * up`` quantized, down writing each copy to its token's
    place, the weighted sum), the bits of the backend's launches one by one; what the shape fixes worked out once.
    Called as ``(x [T, H], topk_ids [T, k], topk_weights [T, k], gate_up, down) -> [T, H]`` with ``x`` and the weights
    contiguous in bf16 or fp16, the ids contiguous integers, the two prepared grouped weights the plan was made for."""

    tokens: int
    topk: int
    experts: int
    hidden: int
    width: int
    fp16: int
    configs: tuple[int, ...]  # gate/up's tn, wn, stages, persistent, then down's
    workspace: int  # bytes of scratch
    device: int
    capability: tuple[int, int]

    @classmethod
    def make(cls, tokens: int, topk: int, gate_up, down, dtype: torch.dtype, first: WgmmaConfig, second: WgmmaConfig):
        e, two_i, h = gate_up.experts, gate_up.out_features, gate_up.in_features
        for config in (first, second):
            if not config.valid():
                raise ValueError(f"the grouped wgmma kernel cannot run {config}")
        if dtype not in (torch.bfloat16, torch.float16) or tokens < 1 or h % 32 or (two_i // 2) % 32:
            raise ValueError("the routed block's C launch takes bf16/fp16 tokens and K a multiple of 32")
        for weight in (gate_up, down):
            q, s = weight.tensors["qdata"], weight.tensors["block_scale"]
            if not q.is_contiguous() or s.dtype != torch.float32 or s.stride(2) != 1:
                raise ValueError("the grouped wgmma kernel reads contiguous weights and fp32 block scales")
        fp16 = int(dtype == torch.float16)
        capability = torch.cuda.get_device_capability(gate_up.device)
        workspace = library(capability).mxgemm_moe_workspace(tokens, topk, e, h, two_i // 2, 2)
        configs = tuple(int(v) for c in (first, second) for v in (c.tn, c.wn, c.stages, c.persistent))
        return cls(tokens, topk, e, h, two_i // 2, fp16, configs, workspace, gate_up.device.index, capability)

    def __call__(self, x, topk_ids, topk_weights, gate_up, down) -> torch.Tensor:
        if topk_ids.dtype not in (torch.int64, torch.int32):
            topk_ids = topk_ids.long()  # other integer ids hold the same values
        # the C call reads dense rows and weights in x's dtype (no-ops where the caller gave them so)
        x, topk_ids, topk_weights = x.contiguous(), topk_ids.contiguous(), topk_weights.to(x.dtype).contiguous()
        gu, dn = gate_up.tensors, down.tensors
        gs, ds = gu["block_scale"], dn["block_scale"]
        ws = torch.empty(self.workspace, dtype=torch.uint8, device=x.device)
        out = torch.empty((self.tokens, self.hidden), dtype=x.dtype, device=x.device)
        err = library(self.capability).mxgemm_moe_experts(
            x.data_ptr(),
            topk_ids.data_ptr(),
            int(topk_ids.dtype == torch.int64),
            topk_weights.data_ptr(),
            gu["qdata"].data_ptr(),
            gs.data_ptr(),
            gs.stride(0),
            gs.stride(1),
            dn["qdata"].data_ptr(),
            ds.data_ptr(),
            ds.stride(0),
            ds.stride(1),
            ws.data_ptr(),
            out.data_ptr(),
            self.tokens,
            self.topk,
            self.experts,
            self.hidden,
            self.width,
            self.fp16,
            *self.configs,
            raw_stream(self.device),
        )
        if err:
            raise RuntimeError(f"mxgemm routed block (grouped wgmma kernel) failed: CUDA error {err}")
        return out
