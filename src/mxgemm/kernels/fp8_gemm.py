"""The hand-written FP8 GEMM for Hopper (``csrc/fp8_gemm.cu``, sm_90a: TMA loads, ``wgmma``): the ``hybrid_sm90``
weight (E4M3 ``[Np, Kp]``, fp32 128x128 block scales) times activations quantized per 1x128 (the cuBLASLt path's
quantizer and numerics), with K split over a thread-block cluster so that small and mid M keep the whole GPU busy,
where cuBLASLt's blockwise kernel runs few CTAs. Two kernels: swap-AB (64 weight rows as wgmma's M, 8-128 tokens its
N) and, above M = 32 by default, tokens as wgmma's M (64 or 128 tokens per CTA sharing a 64- or 128-row weight
tile). The 1x128 activation quantizer is a CUDA kernel of the same library, and :func:`linear_plan` launches it and
the GEMM (as its programmatic dependent) in one ctypes call, its arguments worked out once; outside CUDA-graph capture
that call launches one fused kernel instead, which loads the bf16 activations with TMA and quantizes them in shared
memory (the same bits, one launch's host time less). Built with nvcc on first use (``kernels/nvcc.py``), loaded with
ctypes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from ..availability import Availability
from ..block128 import padded_1x128_shape
from . import check_bf16_bias, nvcc, raw_stream

logger = logging.getLogger("mxgemm")

__all__ = ["TOKEN_TILES", "default_beats_cublas", "default_config", "fp8_gemm", "fp8_gemm_status", "fp8_linear",
           "library", "linear_plan", "quantize_1x128", "tactic_configs", "valid_config"]  # fmt: skip

_SOURCE = Path(__file__).parent / "csrc" / "fp8_gemm.cu"
TOKEN_TILES = (8, 16, 32, 64, 128)  # tokens per CTA (wgmma N); more tokens run more CTAs
STAGES = (2, 4, 6)  # depths of the TMA ring
_SMEM_PER_SM = 228 * 1024  # SM90


def _max_ctas_per_sm(tn: int) -> int:
    """CTAs one SM holds by registers: 4 with 32-128 tokens (96+ registers per thread; measured), 8 with 8-16 (~45,
    ptxas)."""
    return 4 if tn >= 32 else 8


_P, _I = ctypes.c_void_p, ctypes.c_int
# W, S, s_stride, X, XS, bias, Y, ldy, M, Mp, N, Np, Kp
_GEMM_ARGS = [_P, _P, _I, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I]
_QUANT_ARGS = [_P, _I, _I, _I, _I, _P, _P, _I, _I, _P]  # X, ldx, x_fp16, M, K, XQ, XS, Mp, Kp, stream
_RUN_ARGS = [_P, _P, _I, _P, _P, _P]  # plan, X, ldx, bias, Y, stream
# how mxgemm_fp8_linear_run launches: quantizer + GEMM, the fused kernel, or that one unless the stream is capturing
_FUSED = {False: 0, True: 1, "auto": 2}


class _LinearPlan(ctypes.Structure):
    """``LinearPlan`` of csrc/fp8_gemm.cu: a call's fixed arguments."""

    _fields_ = [("W", _P), ("S", _P)] + [(name, _I) for name in ("s_stride", "x_fp16", "K", "M", "Mp", "N", "Np", "Kp",
               "tokm", "tn", "rows", "kc", "splits", "stages", "fused")] + [("ws_offset", ctypes.c_longlong),
               ("q_bytes", ctypes.c_longlong)]  # fmt: skip


@functools.cache
def library(capability: tuple[int, int]) -> ctypes.CDLL:
    """Build (once, cached on disk) and load the kernel for sm_90a. Raises RuntimeError when it cannot be built."""
    names = ("mxgemm_fp8_gemm", "mxgemm_fp8_gemm_tokm", "mxgemm_quant_1x128", "mxgemm_fp8_linear_run")
    lib = nvcc.build(_SOURCE, capability, suffix="a", symbols=names)
    for name, args in (
        ("mxgemm_fp8_gemm", [*_GEMM_ARGS, *[_I] * 6, _P]),  # + tn, rw, kc, splits, stages, pdl, stream
        ("mxgemm_fp8_gemm_tokm", [*_GEMM_ARGS, *[_I] * 5, _P]),  # + tn, wn, splits, stages, pdl, stream
        ("mxgemm_quant_1x128", _QUANT_ARGS),
        ("mxgemm_fp8_linear_run", _RUN_ARGS),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, _I
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


def _smem_bytes(cfg: dict, k_padded: int) -> int:
    """Shared memory of one CTA, as the launcher sizes it (+ 1 KiB the driver reserves)."""
    tn, st = cfg["TN"], cfg["ST"]
    kblocks = k_padded // 128 // cfg["SPLITS"]
    if "WN" in cfg:  # tokens as wgmma M: one weight tile of WN rows, one row of weight scales
        return st * (cfg["WN"] + tn) * 128 + st * tn * 4 + 16 * st + kblocks * 4 + 2048
    rw = cfg["RW"]
    return st * (rw * 64 + tn) * 128 + st * tn * 4 + 16 * st + rw * kblocks * 4 + 2048


def _fitting_tile(m: int) -> int:
    """The smallest token tile that holds M tokens (64 above M = 64)."""
    return next(t for t in TOKEN_TILES if t >= min(m, 64))


def default_config(m: int, n_padded: int, k_padded: int, sms: int) -> dict:
    """Above M = 32: tokens as wgmma M (``WN`` = 64 weight rows per CTA, 64 tokens up to M = 64 and 128 above), 2 K
    splits while twice the tiles fit on the SMs, 6 ring stages up to four tiles per SM (4 beyond). Up to M = 32, the
    smallest token tile that holds M; where the tiles fit in one CTA per SM, two consumer warpgroups per row tile
    (``KC`` = 2), 2 K splits if the CTAs still fit, 6 stages; otherwise one warpgroup, 2 K splits while the tiles
    number fewer than two per SM, and the deepest ring (6, 4, 2) with which every CTA is resident at once. The best or
    near-best config of each 8B / 70B / 7168-hidden projection at M = 16 and 64 on the H200; the
    tuner picks per shape."""
    even = (k_padded // 128) % 2 == 0
    if m > 32:
        tn = 64 if m <= 64 else 128
        tiles = -(-n_padded // 64) * -(-m // tn)
        splits = 2 if 2 * tiles <= sms and even else 1
        return {"TN": tn, "WN": 64, "SPLITS": splits, "ST": 6 if tiles <= 4 * sms else 4}
    tn = _fitting_tile(m)
    tiles = -(-n_padded // 64) * -(-m // tn)
    if tiles <= sms:
        return {"TN": tn, "RW": 1, "SPLITS": 2 if 2 * tiles <= sms and even else 1, "ST": 6, "KC": 2}
    splits = 2 if tiles < 2 * sms and even else 1
    for st in (6, 4, 2):
        cfg = {"TN": tn, "RW": 1, "SPLITS": splits, "ST": st}
        if tiles * splits <= sms * min(_max_ctas_per_sm(tn), _SMEM_PER_SM // _smem_bytes(cfg, k_padded)):
            break
    return cfg


def default_beats_cublas(m: int, n_padded: int, sms: int) -> bool:
    """Whether ``default_config`` is the better default than cuBLASLt's blockwise GEMM for M tokens and ``n_padded``
    weight rows: up to M = 64 always; up to M = 128 while its CTAs (one per 64 weight rows, 128 tokens) fit on the SMs
    in one wave. Measured on the H200 (132 SMs): at M = 72, 96 and 128 faster on the
    7 of 12 projections with N <= 8192 (up to 128 tiles; 11-44% less time), slower on the 5 with N >= 9216 (144+
    tiles: a second, near-empty wave; 10-45% more); at M = 256 cuBLASLt is faster on 10 of 12 (the tuner takes ours
    where it wins)."""
    return m <= 64 or (m <= 128 and -(-n_padded // 64) <= sms)


def tactic_configs(m: int, k_padded: int) -> list[dict]:
    """The configs the tuner tries: the token tile that fits M (and 128 above M = 64), one or two row tiles per CTA,
    one or two consumer warpgroups per row tile (``KC``, with one row tile), 1, 2 or 4 K splits, each ring depth; above
    M = 32 also tokens as wgmma M with 64 or 128 weight rows per CTA."""
    tiles = (_fitting_tile(m),) if m <= 64 else (64, 128)
    configs = [{"TN": tn, "RW": rw, "SPLITS": sp, "ST": st} | ({"KC": 2} if kc == 2 else {}) for tn in tiles
               for rw, kc in ((1, 1), (2, 1), (1, 2)) for sp in (1, 2, 4) for st in STAGES]  # fmt: skip
    if m > 32:
        configs += [{"TN": tn, "WN": wn, "SPLITS": sp, "ST": st} for tn in tiles for wn in (64, 128)
                    for sp in (1, 2, 4) for st in STAGES]  # fmt: skip
    return [c for c in configs if valid_config(c, k_padded)]


def valid_config(cfg: dict, k_padded: int) -> bool:
    """Swap-AB (weight rows as wgmma M): ``TN`` tokens per CTA (``TOKEN_TILES``), ``RW`` 64-row weight tiles per CTA
    (1, 2), ``KC`` consumer warpgroups per row tile taking alternate K blocks (1 when absent; 2 with one row tile).
    Tokens as wgmma M (a ``WN`` key): ``TN`` tokens per CTA (64, 128; a consumer warpgroup per 64), ``WN`` weight rows
    per CTA (64, 128). Both: ``SPLITS`` K splits in one cluster (1-8, whole 128-deep blocks each), ``ST`` TMA ring
    stages (``STAGES``), all in one SM's shared memory."""
    if "WN" in cfg:  # tokens as wgmma M: TN tokens (64, 128) and WN weight rows (64, 128) per CTA
        tiles = cfg.keys() == {"TN", "WN", "SPLITS", "ST"} and cfg["TN"] in (64, 128) and cfg["WN"] in (64, 128)
    else:
        keys = cfg.keys() - {"KC"} == {"TN", "RW", "SPLITS", "ST"}
        tiles = keys and cfg["TN"] in TOKEN_TILES and (cfg["RW"], cfg.get("KC", 1)) in ((1, 1), (2, 1), (1, 2))
    splits = cfg.get("SPLITS")
    return (
        tiles
        and splits in range(1, 9)
        and cfg.get("ST") in STAGES
        and _smem_bytes(cfg, k_padded) <= _SMEM_PER_SM
        and (k_padded // 128) % splits == 0
    )


def fp8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    m: int,
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    config: dict,
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
    if not valid_config(config, kp) or xs.stride() != (1, mp) or qdata.shape[1] != kp:
        raise ValueError(f"the FP8 kernel cannot run config {config} on [{mp}, {kp}] x [{np_}, {qdata.shape[1]}]")
    lib = library(torch.cuda.get_device_capability(xq.device))
    y = torch.empty((m, n), dtype=torch.bfloat16, device=xq.device) if out is None else out
    if y.shape != (m, n) or y.dtype != torch.bfloat16 or not y.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 [{m}, {n}] tensor, got {y.dtype} {tuple(y.shape)}")
    check_bf16_bias(bias, n)
    bias_ptr = None if bias is None else bias.data_ptr()
    common = (qdata.data_ptr(), block_scale.data_ptr(), block_scale.stride(0), xq.data_ptr(), xs.data_ptr(),
              bias_ptr, y.data_ptr(), y.stride(0), m, mp, n, np_, kp)  # fmt: skip
    stream = raw_stream(xq.device.index)
    if "WN" in config:
        err = lib.mxgemm_fp8_gemm_tokm(*common, config["TN"], config["WN"], config["SPLITS"], config["ST"], int(pdl),
                                       stream)  # fmt: skip
    else:
        err = lib.mxgemm_fp8_gemm(*common, config["TN"], config["RW"], config.get("KC", 1), config["SPLITS"],
                                  config["ST"], int(pdl), stream)  # fmt: skip
    if err:
        raise RuntimeError(f"mxgemm FP8 kernel failed to launch (cudaError {err}) for M={m} config {config}")
    return y


def quantize_1x128(x: torch.Tensor, rows_multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA 1x128 quantizer, with the contract of :func:`mxgemm.kernels.act_quant.quantize_1x128_padded`
    (bit-exact to :func:`mxgemm.block128.quantize_1x128`): ``x`` [M, K] bf16/fp16 (unit stride along K) ->
    (float8_e4m3fn [Mp, Kp], fp32 scale view [Mp, Kp/128] with strides (1, Mp)), zeros past M and K."""
    m, k = x.shape
    mp, kp = padded_1x128_shape(m, k, rows_multiple)
    if x.dtype not in (torch.bfloat16, torch.float16) or x.stride(1) != 1:
        raise ValueError(f"x must be bf16/fp16 with unit stride along K, got {x.dtype} strides {x.stride()}")
    q = torch.empty((mp, kp), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((kp // 128, mp), dtype=torch.float32, device=x.device)
    lib = library(torch.cuda.get_device_capability(x.device))
    err = lib.mxgemm_quant_1x128(x.data_ptr(), x.stride(0), int(x.dtype == torch.float16), m, k, q.data_ptr(),
                                 s.data_ptr(), mp, kp, raw_stream(x.device.index))  # fmt: skip
    if err:
        raise RuntimeError(f"mxgemm 1x128 quantizer failed to launch (cudaError {err}) for x {tuple(x.shape)}")
    return q, s.t()


def linear_plan(
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    k: int,
    m: int,
    config: dict,
    fused: bool | str = "auto",
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``(x, bias) -> y`` for M rows on this weight and config: ``x`` [M, k] bf16/fp16 (unit stride along K),
    ``bias`` contiguous bf16 [n] or None, ``y`` bf16 [M, n]. One ctypes call, whose arguments but for the pointers of
    ``x``, ``bias`` and the fresh buffer are computed here, once, launches either the quantizer and the GEMM as its
    programmatic dependent (``fused=False``) or one kernel that quantizes in shared memory (``True``: bf16 ``x`` with
    16-byte aligned rows, a swap-AB config of one row tile and up to 32 tokens, its stages, which grow by the bf16
    tile, within shared memory); both give the same bits. ``"auto"``: the fused kernel where it can run and the
    stream is not capturing a CUDA graph (eager calls are bound by host time, and it saves a launch), else the two
    (under graph replay only device time counts)."""
    np_, kp = qdata.shape
    if not valid_config(config, kp) or fused not in _FUSED:
        raise ValueError(f"the FP8 kernel cannot run config {config} (fused={fused!r}) on a [{np_}, {kp}] weight")
    tokm = "WN" in config
    mp, _ = padded_1x128_shape(m, k, config["TN"] if tokm else 1)  # whole token tiles: no box reads past the tensor
    q_bytes = mp * kp
    # one allocation a call (each costs microseconds of host time): the output's m rows, then, 256-byte aligned, the
    # quantized activations and their scales in rows past m
    ws_offset = -(-m * n * 2 // 256) * 256
    rows = -(-(ws_offset + q_bytes + 4 * mp * (kp // 128)) // (2 * n))
    device = qdata.device
    fn = library(torch.cuda.get_device_capability(device)).mxgemm_fp8_linear_run
    plan = _LinearPlan(qdata.data_ptr(), block_scale.data_ptr(), block_scale.stride(0), 0, k, m, mp, n, np_, kp,
                       int(tokm), config["TN"], config["WN"] if tokm else config["RW"], config.get("KC", 1),
                       config["SPLITS"], config["ST"], _FUSED[fused], ws_offset, q_bytes)  # fmt: skip
    plans = {torch.bfloat16: plan, torch.float16: _LinearPlan.from_buffer_copy(plan)}
    plans[torch.float16].x_fp16 = 1
    addresses = {dtype: ctypes.addressof(p) for dtype, p in plans.items()}
    index = device.index

    def launch(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        buf = torch.empty((rows, n), dtype=torch.bfloat16, device=device)
        err = fn(addresses[x.dtype], x.data_ptr(), x.stride(0), None if bias is None else bias.data_ptr(),
                 buf.data_ptr(), raw_stream(index))  # fmt: skip
        if err:
            why = f"cudaError {err}" if err > 0 else "no fused kernel for this config, or its stages exceed smem"
            raise RuntimeError(f"mxgemm FP8 linear failed to launch ({why}) for M={m} config {config} fused={fused}")
        return buf[:m]

    launch.plans = plans  # the structures the addresses point into live as long as the launcher
    return launch


def fp8_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    config: dict,
    bias: torch.Tensor | None = None,
    fused: bool | str = "auto",
) -> torch.Tensor:
    """``x`` [M, K] bf16/fp16, quantized per 1x128, times the re-encoded weight (+ a bf16 ``bias``) -> bf16 [M, n]
    (the numerics of ``cublas_block_linear``); ``fused`` as for :func:`linear_plan`."""
    if x.stride(1) != 1:
        x = x.contiguous()
    check_bf16_bias(bias, n)
    return linear_plan(qdata, block_scale, n, x.shape[1], x.shape[0], config, fused)(x, bias)
