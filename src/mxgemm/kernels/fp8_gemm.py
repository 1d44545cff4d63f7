"""The hand-written FP8 GEMM for Hopper (``csrc/fp8_gemm.cu``, sm_90a: TMA loads, ``wgmma``): the ``hybrid_sm90``
weight (E4M3 ``[Np, Kp]``, fp32 128x128 block scales) times activations quantized per 1x128 (the cuBLASLt path's
quantizer and numerics), with K split over a thread-block cluster so that small and mid M keep the whole GPU busy,
where cuBLASLt's blockwise kernel runs few CTAs. Two kernels: swap-AB (64 weight rows as wgmma's M, 8-128 tokens its
N; :class:`SwapAB`) and tokens as wgmma's M (64 or 128 tokens per CTA sharing a 64- or 128-row weight tile;
:class:`TokensAsM`); which config runs is the backend's choice. The 1x128 activation quantizer is a CUDA kernel of
the same library, and :func:`linear_plan` launches it and the GEMM (as its programmatic dependent) in one ctypes
call, its arguments worked out once. Built with nvcc on first use (``kernels/nvcc.py``), loaded with ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..availability import Availability
from ..block128 import padded_1x128_shape
from . import (
    GATED,
    ROWS_BIAS,
    Launch,
    LaunchEntry,
    address,
    check_bf16_bias,
    free_with,
    nvcc,
    raw_stream,
    rows_in_place,
    shaped_as,
)

logger = logging.getLogger("mxgemm")

__all__ = [
    "STAGES",
    "TOKEN_TILES",
    "Fp8Config",
    "SwapAB",
    "TokensAsM",
    "fp8_gemm",
    "fp8_gemm_status",
    "fp8_linear",
    "library",
    "linear_plan",
    "quantize_1x128",
]

_SOURCE = Path(__file__).parent / "csrc" / "fp8_gemm.cu"
TOKEN_TILES = (8, 16, 32, 64, 128)  # tokens per CTA (wgmma N); more tokens run more CTAs
STAGES = (2, 4, 6)  # depths of the TMA ring
_SMEM_PER_SM = 228 * 1024  # SM90


_P, _I = ctypes.c_void_p, ctypes.c_int
# W, S, s_stride, X, XS, bias, Y, ldy, M, Mp, N, Np, Kp
_GEMM_ARGS = [_P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I]
_QUANT_ARGS = [_P, _I, _I, _I, _I, _P, _P, _I, _I, _P]  # X, ldx, x_fp16, M, K, XQ, XS, Mp, Kp, stream
_GATED_ARGS = [_P, _I, *_QUANT_ARGS]  # G, ldg, then U, ldu, ... as _QUANT_ARGS
_RUN_ARGS = [_P, _P, _I, _P, _P, _P]  # plan, X, ldx, bias, Y, stream
_GATED_RUN_ARGS = [_P, _P, _I, _P, _I, _P, _P, _P]  # plan, G, ldg, U, ldu, bias, Y, stream


class _LinearPlan(ctypes.Structure):
    """``LinearPlan`` of csrc/fp8_gemm.cu: a call's fixed arguments."""

    _fields_ = (
        [("W", _P), ("S", _P)]
        + [
            (name, _I)
            for name in (
                "s_stride",
                "x_fp16",
                "K",
                "M",
                "Mp",
                "N",
                "Np",
                "Kp",
                "tokm",
                "tn",
                "rows",
                "kc",
                "splits",
                "stages",
            )
        ]
        + [
            ("ws_offset", ctypes.c_longlong),
            ("q_bytes", ctypes.c_longlong),
            ("graph", _P),
            ("graphed", _I),
            ("reserved", _I),
        ]
    )


@functools.cache
def library(capability: tuple[int, int]) -> ctypes.CDLL:
    """Build (once, cached on disk) and load the kernel for sm_90a. Raises RuntimeError when it cannot be built."""
    names = (
        "mxgemm_fp8_gemm",
        "mxgemm_fp8_gemm_tokm",
        "mxgemm_quant_1x128",
        "mxgemm_quant_gated_1x128",
        "mxgemm_fp8_linear_run",
        "mxgemm_fp8_linear_gated_run",
        "mxgemm_fp8_linear_plan_free",
    )
    lib = nvcc.build(_SOURCE, capability, suffix="a", symbols=names)
    for name, args in (
        ("mxgemm_fp8_gemm", [*_GEMM_ARGS, *[_I] * 6, _P]),  # + tn, rw, kc, splits, stages, pdl, stream
        ("mxgemm_fp8_gemm_tokm", [*_GEMM_ARGS, *[_I] * 5, _P]),  # + tn, wn, splits, stages, pdl, stream
        ("mxgemm_quant_1x128", _QUANT_ARGS),
        ("mxgemm_quant_gated_1x128", _GATED_ARGS),
        ("mxgemm_fp8_linear_run", _RUN_ARGS),
        ("mxgemm_fp8_linear_gated_run", _GATED_RUN_ARGS),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _I
    lib.mxgemm_fp8_linear_plan_free.argtypes, lib.mxgemm_fp8_linear_plan_free.restype = [_P], None
    return lib


@functools.cache
def fp8_gemm_status(capability: tuple[int, int] | None) -> Availability:
    """Whether the kernel is built and loaded here (built on first call); the reason if not."""
    if capability != (9, 0):
        return Availability(False, "the FP8 wgmma kernel is built for SM90 (sm_90a) only")
    try:
        library(capability)
    except (RuntimeError, OSError) as exc:
        logger.info("mxgemm: FP8 wgmma kernel unavailable: %s", exc)
        return Availability(False, f"FP8 wgmma kernel unavailable: {exc}")
    return Availability(True, "FP8 wgmma kernel built for sm_90a")


@dataclass(frozen=True)
class SwapAB:
    """Weight rows as wgmma's M (64 per row tile): ``tn`` tokens per CTA (``TOKEN_TILES``), ``rw`` row tiles per CTA
    (1, 2), ``kc`` consumer warpgroups per row tile taking alternate K blocks (1; 2 with one row tile), ``splits`` K
    splits in one cluster (1-8, whole 128-deep blocks each), ``stages`` TMA ring depth (``STAGES``)."""

    tn: int
    rw: int = 1
    kc: int = 1
    splits: int = 1
    stages: int = 6

    def smem_bytes(self, k_padded: int) -> int:
        """Shared memory of one CTA, as the launcher sizes it (+ 1 KiB the driver reserves)."""
        kblocks = k_padded // 128 // self.splits
        return self.stages * ((self.rw * 64 + self.tn) * 128 + self.tn * 4 + 16) + self.rw * kblocks * 4 + 2048

    def valid(self, k_padded: int) -> bool:
        tiles = self.tn in TOKEN_TILES and (self.rw, self.kc) in ((1, 1), (2, 1), (1, 2))
        return tiles and _valid_ring(self, k_padded)

    def ctas_per_sm(self, k_padded: int) -> int:
        """CTAs one SM holds at once, by registers (4 with 32-128 tokens: 96+ registers a thread, measured; 8 with
        8-16: about 45, ptxas) and by shared memory."""
        return min(4 if self.tn >= 32 else 8, _SMEM_PER_SM // self.smem_bytes(k_padded))


@dataclass(frozen=True)
class TokensAsM:
    """Tokens as wgmma's M: ``tn`` tokens per CTA (64, 128; a consumer warpgroup per 64) sharing a tile of ``wn``
    weight rows (64, 128); ``splits`` and ``stages`` as for :class:`SwapAB`."""

    tn: int
    wn: int = 64
    splits: int = 1
    stages: int = 6

    def smem_bytes(self, k_padded: int) -> int:
        """Shared memory of one CTA, as the launcher sizes it (+ 1 KiB the driver reserves)."""
        kblocks = k_padded // 128 // self.splits
        return self.stages * ((self.wn + self.tn) * 128 + self.tn * 4 + 16) + kblocks * 4 + 2048

    def valid(self, k_padded: int) -> bool:
        return self.tn in (64, 128) and self.wn in (64, 128) and _valid_ring(self, k_padded)


Fp8Config = SwapAB | TokensAsM


def _valid_ring(cfg: Fp8Config, k_padded: int) -> bool:
    """K splits that divide the 128-deep blocks (at most 8 in a cluster) and a ring that fits one SM."""
    return (
        cfg.splits in range(1, 9)
        and (k_padded // 128) % cfg.splits == 0
        and cfg.stages in STAGES
        and cfg.smem_bytes(k_padded) <= _SMEM_PER_SM
    )


def fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    m: int,
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    config: Fp8Config,
    pdl: bool = True,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``xq`` e4m3 [Mp, Kp] and ``xs`` fp32 [Mp, Kp/128] (a view with strides (1, Mp)) as the 1x128 quantizer writes
    them, ``qdata`` e4m3 [Np, Kp], ``block_scale`` fp32 [>= Np/128, Kp/128] -> bf16 [m, n]. ``pdl``: launch as a
    programmatic dependent of the kernel before (the quantizer), loading the first weight tiles while it runs;
    ``out``: a contiguous bf16 [m, n] to write into; ``bias``: bf16 [n], added before the output's rounding."""
    mp, kp = xq.shape
    np_ = qdata.shape[0]
    if not config.valid(kp) or xs.stride() != (1, mp) or qdata.shape[1] != kp:
        raise ValueError(f"the FP8 kernel cannot run config {config} on [{mp}, {kp}] x [{np_}, {qdata.shape[1]}]")
    lib = library(torch.cuda.get_device_capability(xq.device))
    y = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device) if out is None else out
    if y.shape != (m, n) or y.dtype != torch.bfloat16 or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [{m}, {n}] tensor, got {y.dtype} {tuple(y.shape)}")
    check_bf16_bias(bias, n)
    bias_ptr = None if bias is None else bias.data_ptr()
    common = (
        qdata.data_ptr(),
        block_scale.data_ptr(),
        block_scale.stride(0),
        xq.data_ptr(),
        xs.data_ptr(),
        bias_ptr,
        y.data_ptr(),
        y.stride(0),
        m,
        mp,
        n,
        np_,
        kp,
    )
    stream = raw_stream(xq.device.index)
    c = config
    if isinstance(c, TokensAsM):
        err = lib.mxgemm_fp8_gemm_tokm(*common, c.tn, c.wn, c.splits, c.stages, int(pdl), stream)
    else:
        err = lib.mxgemm_fp8_gemm(*common, c.tn, c.rw, c.kc, c.splits, c.stages, int(pdl), stream)
    if err:
        raise RuntimeError(f"mxgemm FP8 kernel failed to launch (cudaError {err}) for M={m} config {config}")
    return y


def quantize_1x128(
    x: torch.Tensor, rows_multiple: int = 1, up: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA 1x128 quantizer, with the contract of :func:`mxgemm.kernels.act_quant.quantize_1x128_padded`
    (bit-exact to :func:`mxgemm.block128.quantize_1x128`): ``x`` [M, K] bf16/fp16 (unit stride along K) ->
    (float8_e4m3fn [Mp, Kp], fp32 scale view [Mp, Kp/128] with strides (1, Mp)), zeros past M and K. With ``up`` (as
    ``x``), of the product a gated MLP feeds its down projection instead, ``silu(x) * up`` as PyTorch computes it in
    ``x.dtype``, read from the two in one kernel: the same bits as quantizing that product."""
    m, k = x.shape
    mp, kp = padded_1x128_shape(m, k, rows_multiple)
    for t in (x,) if up is None else (x, up):
        if t.dtype not in (torch.bfloat16, torch.float16) or t.stride(1) != 1 or t.shape != x.shape:
            raise ValueError(
                f"x (and up) must be bf16/fp16 [M, K] with unit stride along K, got {t.dtype} "
                f"{tuple(t.shape)} strides {t.stride()}"
            )
    if up is not None and up.dtype != x.dtype:
        raise ValueError(f"up must be {x.dtype} as x, got {up.dtype}")
    q = torch.empty((mp, kp), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((kp // 128, mp), dtype=torch.float32, device=x.device)
    lib = library(torch.cuda.get_device_capability(x.device))
    args = (int(x.dtype == torch.float16), m, k, q.data_ptr(), s.data_ptr(), mp, kp, raw_stream(x.device.index))
    if up is None:
        err = lib.mxgemm_quant_1x128(x.data_ptr(), x.stride(0), *args)
    else:
        err = lib.mxgemm_quant_gated_1x128(x.data_ptr(), x.stride(0), up.data_ptr(), up.stride(0), *args)
    if err:
        raise RuntimeError(f"mxgemm 1x128 quantizer failed to launch (cudaError {err}) for x {tuple(x.shape)}")
    return q, s.t()


def linear_plan(
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    k: int,
    m: int,
    config: Fp8Config,
    graphed: bool = True,
) -> Launch:
    """The :class:`~mxgemm.kernels.Launch` ``(x, bias) -> y`` for M rows on this weight and config: ``x`` [M, k]
    bf16/fp16, or [..., k] whose leading dimensions hold M rows (copied first where its rows are not evenly strided with
    unit stride along K), ``bias`` contiguous bf16 [n] or None, ``y`` bf16 [M, n] (or [..., n]). One ctypes call, whose
    arguments but for the pointers of ``x``, ``bias`` and the fresh buffer are computed here, once, launches the
    quantizer and the GEMM as its programmatic dependent. ``graphed``: outside stream capture, the plan's calls launch
    the two as one CUDA graph of the plan's (made on the first such call), their arguments set per call: one launch's
    host time for both. ``.gated(gate, up, bias)``: the call on the product a gated MLP feeds its down projection,
    ``silu(gate) * up`` as PyTorch computes it in their dtype ([M, k] each, unit stride along K), quantized by one
    kernel that reads both, then the GEMM: the bits of the call on that product (a graph of its own). ``.entry`` of
    both: their bf16 plans as C++ calls them, which launch the kernels directly, the GEMM as the quantizer's
    programmatic dependent (never graphed).

    What each way costs in host and device time is measured in docs/performance.md ("Eager calls and whole
    models")."""
    np_, kp = qdata.shape
    if not config.valid(kp):
        raise ValueError(f"the FP8 kernel cannot run config {config} on a [{np_}, {kp}] weight")
    tokm = isinstance(config, TokensAsM)
    mp, _ = padded_1x128_shape(m, k, config.tn if tokm else 1)  # whole token tiles: no box reads past the tensor
    q_bytes = mp * kp
    # one allocation a call (each costs microseconds of host time): the output's m rows, then, 256-byte aligned, the
    # quantized activations and their scales in rows past m
    ws_offset = -(-m * n * 2 // 256) * 256
    rows = -(-(ws_offset + q_bytes + 4 * mp * (kp // 128)) // (2 * n))
    device = qdata.device
    lib = library(torch.cuda.get_device_capability(device))
    fn = lib.mxgemm_fp8_linear_run
    plan = _LinearPlan(
        qdata.data_ptr(),
        block_scale.data_ptr(),
        block_scale.stride(0),
        0,
        k,
        m,
        mp,
        n,
        np_,
        kp,
        int(tokm),
        config.tn,
        config.wn if tokm else config.rw,
        1 if tokm else config.kc,
        config.splits,
        config.stages,
        ws_offset,
        q_bytes,
    )
    plan.graphed = int(graphed)
    # one plan a dtype and kind of call (plain, gated): each keeps the graph of its own kernels; C++ calls (bf16)
    # take plans of their own, which launch the kernels directly
    plans = {
        (dtype, gated, entry): _LinearPlan.from_buffer_copy(plan)
        for dtype in (torch.bfloat16, torch.float16)
        for gated in (False, True)
        for entry in (False, True)
        if not entry or dtype == torch.bfloat16
    }
    for (dtype, _, entry), p in plans.items():
        p.x_fp16 = int(dtype == torch.float16)
        p.graphed = 0 if entry else p.graphed
    addresses = {dtype: ctypes.addressof(plans[dtype, False, False]) for dtype in (torch.bfloat16, torch.float16)}
    gated_addresses = {dtype: ctypes.addressof(plans[dtype, True, False]) for dtype in (torch.bfloat16, torch.float16)}
    gated_fn = lib.mxgemm_fp8_linear_gated_run
    index = device.index

    def launch(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = rows_in_place(x)
        # integer sizes, and the output's shape set by resize_ rather than by a slice or a view: on a CPU host 1.3 µs,
        # against 2.4 for the empty of a size tuple and a slice, and 1.3 more for a view
        y = torch.empty(rows, n, dtype=torch.bfloat16, device=device)
        err = fn(
            addresses[x.dtype],
            x.data_ptr(),
            x.stride(0) if x.dim() == 2 else k,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            raw_stream(index),
        )
        if err:
            _launch_failed(err, m, config)
        return shaped_as(y, x, m, n)

    def gated(gate: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.empty(rows, n, dtype=torch.bfloat16, device=device)
        err = gated_fn(
            gated_addresses[gate.dtype],
            gate.data_ptr(),
            gate.stride(0),
            up.data_ptr(),
            up.stride(0),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            raw_stream(index),
        )
        if err:
            _launch_failed(err, m, config)
        return shaped_as(y, gate, m, n)

    gated_entry = LaunchEntry(GATED, address(gated_fn), ctypes.addressof(plans[torch.bfloat16, True, True]), rows, n)
    planned = Launch(
        launch,
        entry=LaunchEntry(ROWS_BIAS, address(fn), ctypes.addressof(plans[torch.bfloat16, False, True]), rows, n),
        gated=Launch(gated, entry=gated_entry),
        keep=plans,  # the structures the addresses point into
    )
    free_with(planned, lib.mxgemm_fp8_linear_plan_free, plans.values())
    return planned


def _launch_failed(err: int, m: int, config: Fp8Config) -> None:
    raise RuntimeError(f"mxgemm FP8 linear failed to launch (cudaError {err}) for M={m} config {config}")


def fp8_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    config: Fp8Config,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` [M, K] bf16/fp16, quantized per 1x128, times the re-encoded weight (+ a bf16 ``bias``) -> bf16 [M, n]
    (the numerics of ``cublaslt.blockwise_linear``)."""
    check_bf16_bias(bias, n)
    return linear_plan(qdata, block_scale, n, x.shape[1], x.shape[0], config)(x, bias)
