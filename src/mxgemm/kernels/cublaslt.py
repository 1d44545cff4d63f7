"""cuBLASLt's blockwise FP8 GEMM (1x128 activation and 128x128 weight scales, Hopper): through ``torch._scaled_mm``
(:func:`blockwise_linear`), or planned once per weight and M (:func:`linear_plan`: ``csrc/blockwise.cu``, the CUDA
1x128 quantizer and ``cublasLtMatmul`` in one ctypes call, descriptors and algorithm made once, where
``_scaled_mm`` works them out on every call); and the probe that answers whether it runs here. cuBLASLt's
constraints are met by the operands' padding (:func:`mxgemm.block128.prepare_block128`,
:func:`mxgemm.block128.padded_1x128_shape`), never by refusing an input.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from ..availability import Availability, probe_against_twin, probe_operands, probe_preconditions
from ..block128 import padded_1x128_shape
from ..device import DeviceInfo
from ..layouts import finish_output, round_up
from . import NO_BIAS, Launch, LaunchEntry, address, nvcc, raw_stream, rows_in_place, shaped_as

logger = logging.getLogger("mxgemm")

__all__ = [
    "PlannedRows",
    "blockwise_device_check",
    "blockwise_linear",
    "header_dir",
    "linear_plan",
    "plan_status",
    "probe_blockwise",
]

_SOURCE = Path(__file__).parent / "csrc" / "blockwise.cu"
_WORKSPACE_MAX = 32 * 2**20  # cuBLASLt workspace the heuristic may ask for; a call allocates what its algorithm needs
_P, _I, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
# errors of csrc/blockwise.cu besides CUDA's (> 0) and cuBLAS statuses (1000 + status)
_ERRORS = {-2: "no cuBLASLt library is loaded in this process", -3: "cuBLASLt offers no algorithm for this problem"}


def blockwise_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    block_scale: torch.Tensor,
    n: int,
    bias: torch.Tensor | None,
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """``x`` [M, K] quantized per 1x128 (with ``quantize``, bit-exact to the Triton quantizer it defaults to) times
    a padded 128x128-block weight (``qdata`` E4M3 [Np, Kp], ``block_scale`` fp32 [Np/128, Kp/128]) -> [M, n] in
    ``x.dtype`` (+ ``bias``)."""
    if quantize is None:
        from .act_quant import quantize_1x128_padded as quantize

    m = x.shape[0]
    xq, xs = quantize(x if x.stride(1) == 1 else x.contiguous())
    # cuBLASLt writes bf16 for block scaling; fp16 callers get it converted
    y = torch._scaled_mm(xq, qdata.t(), xs, block_scale.t(), out_dtype=torch.bfloat16)[:m]
    return finish_output(y, x, bias, n)


@functools.cache
def probe_blockwise(index: int) -> Availability:
    """Run one small blockwise GEMM on CUDA device ``index`` and compare it with its emulated twin (cached)."""

    def run():
        tensors, x, ref = _probe_problem(index)
        return blockwise_linear(x, tensors["qdata"], tensors["block_scale"], 256, None), ref

    return probe_against_twin("cuBLASLt 1x128 x 128x128 blockwise FP8 GEMM", run)


def _probe_problem(index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A probe's operands on CUDA device ``index``: a prepared 256 x 512 block weight, bf16 activations [4, 512] and
    their emulated product."""
    from ..block128 import dequantize_1x128, prepare_block128, quantize_1x128, reencode_block128

    t, x = probe_operands(index, 256, 512, 4)
    tensors, _ = prepare_block128(t.qdata, t.scale)
    ref = dequantize_1x128(*quantize_1x128(x)) @ reencode_block128(t.qdata, t.scale).dequantize().T
    return tensors, x, ref


def blockwise_device_check(device: DeviceInfo) -> Availability:
    """Whether cuBLASLt's blockwise FP8 GEMM runs on ``device`` (Hopper, a torch built with CUDA >= 12.9, a probe)."""
    if device.type != "cuda":
        return Availability(False, f"needs a CUDA GPU; this device is {device.type}")
    if device.capability is None or device.capability[0] != 9:
        return Availability(False, f"cuBLASLt 1x128 x 128x128 blockwise FP8 runs on Hopper (SM90); {device} is not")
    cuda = torch.version.cuda
    if cuda is None or tuple(int(p) for p in cuda.split(".")[:2]) < (12, 9):
        return Availability(False, f"needs a torch built with CUDA >= 12.9 for blockwise scaling, this one has {cuda}")
    missing = probe_preconditions(device, "cuBLASLt")
    return missing if missing is not None else probe_blockwise(device.index)


def header_dir() -> Path | None:
    """The folder of ``cublasLt.h``: the CUDA toolkit's (beside nvcc), or that of the NVIDIA cuBLAS wheel torch
    depends on (``nvidia/cu13/include``, ``nvidia/cublas/include``); None if neither has it."""
    found = nvcc.find_nvcc()
    candidates = [Path(found).resolve().parent.parent / "include"] if found else []
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec and spec.submodule_search_locations else ():
        candidates += [*sorted(Path(root).glob("cu*/include")), Path(root) / "cublas" / "include"]
    return next((d for d in candidates if (d / "cublasLt.h").is_file()), None)


@functools.cache
def _library() -> ctypes.CDLL:
    """Build (once, cached on disk) and load ``csrc/blockwise.cu`` (host code only). Raises RuntimeError when it
    cannot be built."""
    include = header_dir()
    if include is None:
        raise RuntimeError("cublasLt.h was not found (neither in the CUDA toolkit nor in an nvidia-cublas wheel)")
    names = (
        "mxgemm_blockwise_plan_create",
        "mxgemm_blockwise_plan_destroy",
        "mxgemm_blockwise_plan_bytes",
        "mxgemm_blockwise_plan_workspace",
        "mxgemm_blockwise_run",
        "mxgemm_blockwise_gemm",
    )
    lib = nvcc.build(_SOURCE, (9, 0), symbols=names, include_dirs=(include,))
    for name, args, res in (
        ("mxgemm_blockwise_plan_create", [_P, _P, _P, *[_I] * 6, _LL, _LL, _LL, ctypes.POINTER(_P)], _I),
        ("mxgemm_blockwise_plan_destroy", [_P], None),
        ("mxgemm_blockwise_plan_bytes", [_P], _LL),
        ("mxgemm_blockwise_plan_workspace", [_P], _LL),
        ("mxgemm_blockwise_run", [_P, _P, _I, _P, _P], _I),
        ("mxgemm_blockwise_gemm", [_P, _P, _P, _P, _P, _P], _I),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@functools.cache
def plan_status(index: int, capability: tuple[int, int] | None) -> Availability:
    """Whether planned cuBLASLt calls (:func:`linear_plan`) run on CUDA device ``index`` (of ``capability``): the
    CUDA 1x128 quantizer built, ``csrc/blockwise.cu`` built against ``cublasLt.h``, and a probe against the twin;
    the reason if not."""
    from .fp8_gemm import fp8_gemm_status

    quantizer = fp8_gemm_status(capability)
    if not quantizer:
        return Availability(False, f"planned cuBLASLt calls need the CUDA quantizer ({quantizer.reason})")
    try:
        _library()
    except (RuntimeError, OSError) as exc:
        logger.info("mxgemm: planned cuBLASLt calls unavailable: %s", exc)
        return Availability(False, f"planned cuBLASLt calls unavailable: {exc}")

    def run():
        tensors, x, ref = _probe_problem(index)
        return linear_plan(tensors["qdata"], tensors["block_scale"], 256, 512, 4, x.dtype)(x, None), ref

    return probe_against_twin("planned cuBLASLt calls", run)


class PlannedRows(NamedTuple):
    """1x128-quantized activations a planned call's ``.on_quantized`` reads (made by ``.sharing``, or by
    :func:`mxgemm.kernels.fp8_gemm.quantize_1x128`): what keeps them alive, the rows' address (e4m3 [Mp, Kp]), their
    scales' (fp32 [Kp/128, Mp]), Mp and Kp."""

    keep: object
    xq: int
    xs: int
    mp: int
    kp: int


def linear_plan(qdata: torch.Tensor, block_scale: torch.Tensor, n: int, k: int, m: int, x_dtype: torch.dtype) -> Launch:
    """The :class:`~mxgemm.kernels.Launch` ``(x, bias) -> y`` for M rows of ``x_dtype`` (bf16/fp16 [M, k], or [..., k]
    whose leading dimensions hold M rows; copied first where its rows are not evenly strided with unit stride along K)
    on a padded 128x128-block weight (``qdata`` E4M3 [Np, Kp], ``block_scale`` fp32 [Np/128, Kp/128]) -> [M, n] (or
    [..., n]) in ``x.dtype`` (+ ``bias``): the numerics of :func:`blockwise_linear` with the CUDA quantizer. One ctypes
    call quantizes and runs ``cublasLtMatmul`` with the descriptors and algorithm made here, once (:func:`plan_status`
    says whether it runs on a device); ``.sharing`` also answers the quantized rows, for other plans' ``.on_quantized``
    to run their GEMM alone on; ``.entry`` (bf16 activations, weights of whole 128-row blocks) the call without a bias
    as C++ calls it. Raises RuntimeError when cuBLASLt refuses the problem."""
    from .fp8_gemm import library as fp8_library

    np_, kp = qdata.shape
    mp, _ = padded_1x128_shape(m, k)
    ws_offset = round_up(mp * np_ * 2, 256)  # where a call's buffer holds its quantized rows, then their scales
    device = qdata.device
    quantizer = address(fp8_library(torch.cuda.get_device_capability(device)).mxgemm_quant_1x128)
    lib = _library()
    handle = _P()
    with torch.cuda.device(device):
        err = lib.mxgemm_blockwise_plan_create(
            quantizer,
            qdata.data_ptr(),
            block_scale.data_ptr(),
            k,
            m,
            mp,
            np_,
            kp,
            int(x_dtype == torch.float16),
            ws_offset,
            mp * kp,
            _WORKSPACE_MAX,
            ctypes.byref(handle),
        )
    if err:
        raise RuntimeError(f"cuBLASLt blockwise plan for M={m} on [{np_}, {kp}]: {_why(err)}")
    rows = -(-lib.mxgemm_blockwise_plan_bytes(handle) // (2 * np_))
    # the GEMM alone (on_quantized): the output, then cuBLASLt's workspace where a call's buffer holds the rows
    gemm_ws = lib.mxgemm_blockwise_plan_workspace(handle)
    gemm_rows = -(-(ws_offset + gemm_ws) // (2 * np_))
    lt_offset = lib.mxgemm_blockwise_plan_bytes(handle) - gemm_ws  # where a call's buffer holds the workspace
    run, gemm, index = lib.mxgemm_blockwise_run, lib.mxgemm_blockwise_gemm, device.index
    gated_quantizer, fp16 = (
        fp8_library(torch.cuda.get_device_capability(device)).mxgemm_quant_gated_1x128,
        int(x_dtype == torch.float16),
    )
    as_is = n == np_ and x_dtype == torch.bfloat16  # without a bias, the output is the buffer's first M rows

    def finish(buf: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if as_is and bias is None:
            return shaped_as(buf, x, m, n)
        y = finish_output(buf[:m], x, bias, n)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)

    def call(x: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(rows, np_, dtype=torch.bfloat16, device=device)  # as fp8_gemm's launcher: no size tuple
        err = run(handle, x.data_ptr(), x.stride(0) if x.dim() == 2 else k, buf.data_ptr(), raw_stream(index))
        if err:
            raise RuntimeError(f"cuBLASLt blockwise GEMM failed for M={m}: {_why(err)}")
        return buf

    def launch(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = rows_in_place(x)
        return finish(call(x), x, bias)

    def sharing(x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, PlannedRows]:
        """``launch(x, bias)`` and the quantized rows its buffer holds, for ``on_quantized`` of other plans of this M
        and K."""
        x = rows_in_place(x)
        buf = call(x)
        xq = buf.data_ptr() + ws_offset
        return finish(buf, x, bias), PlannedRows(buf, xq, xq + mp * kp, mp, kp)

    def gemm_alone(xq: int, xs: int, buf: torch.Tensor, ws_at: int) -> None:
        """The plan's GEMM on quantized rows at ``xq`` / ``xs`` into ``buf``, cuBLASLt's workspace ``ws_at`` bytes into
        it."""
        y = buf.data_ptr()
        err = gemm(handle, xq, xs, y, y + ws_at if gemm_ws else None, raw_stream(index))
        if err:
            raise RuntimeError(f"cuBLASLt blockwise GEMM failed for M={m}: {_why(err)}")

    def on_quantized(rows: PlannedRows, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The GEMM alone, on ``rows`` quantized from the input ``x`` stands for (``x`` itself, or a tensor of its
        shape and dtype): the bits of ``launch`` on that input."""
        if (rows.mp, rows.kp) != (mp, kp):
            raise ValueError(f"rows quantized for [{rows.mp}, {rows.kp}], not this plan's [{mp}, {kp}]")
        buf = torch.empty(gemm_rows, np_, dtype=torch.bfloat16, device=device)
        gemm_alone(rows.xq, rows.xs, buf, ws_offset)
        return finish(buf, x, bias)

    def gated(gate: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``launch(silu(gate) * up, bias)``, the product (as PyTorch computes it in ``x_dtype``) quantized into the
        call's buffer by one kernel that reads ``gate`` and ``up`` ([M, k] each, unit stride along K): the same
        bits."""
        buf = torch.empty(rows, np_, dtype=torch.bfloat16, device=device)
        xq = buf.data_ptr() + ws_offset
        err = gated_quantizer(
            gate.data_ptr(),
            gate.stride(0),
            up.data_ptr(),
            up.stride(0),
            fp16,
            m,
            k,
            xq,
            xq + mp * kp,
            mp,
            kp,
            raw_stream(index),
        )
        if err:
            raise RuntimeError(f"mxgemm gated 1x128 quantizer failed to launch (cudaError {err}) for M={m}")
        gemm_alone(xq, xq + mp * kp, buf, lt_offset)
        return finish(buf, gate, bias)

    planned = Launch(
        launch,
        # as C++ calls it: bf16 without a bias, the output the buffer's first M rows
        entry=LaunchEntry(NO_BIAS, address(run), handle.value, rows, np_) if as_is else None,
        gated=Launch(gated),
        sharing=sharing,
        on_quantized=on_quantized,
    )
    weakref.finalize(planned, lib.mxgemm_blockwise_plan_destroy, handle)
    return planned


def _why(err: int) -> str:
    if err in _ERRORS:
        return _ERRORS[err]
    return f"cuBLAS status {err - 1000}" if err >= 1000 else f"cudaError {err}"
