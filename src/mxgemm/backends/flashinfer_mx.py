"""``flashinfer_cutlass``, ``flashinfer_cutedsl``, ``flashinfer_trtllm``, ``flashinfer_cudnn``: FlashInfer's MXFP8
GEMMs (``w8a8-mx``).

Availability is FlashInfer's own answer, asked at run time: ``mm_mxfp8.is_backend_supported(<backend>, <cc>)`` with
the device's compute capability as an integer (100, 103, 107, 120, ...), plus the problem constraints FlashInfer
documents (N >= 128, K >= 128; trtllm: K % 256 == 0). mxgemm keeps no list of SM numbers for these backends.

Weights are prepared once: cutlass and cute-dsl take the weight with N padded to a multiple of 32 (CUTLASS writes
bf16 output rows 16-byte aligned, N % 8 == 0, and on SM12x needs N and K multiples of 32) and its scales in the
128x4 layout; trtllm takes N padded to a multiple of 128, rows shuffled by FlashInfer's ``shuffle_matrix_a`` /
``shuffle_matrix_sf_a`` (epilogue tile 128, 32 elements per scale), and 8x4 activation scales. The output is sliced
back to the logical N.
FlashInfer's autotuner tunes these backends' tactics while mxgemm's tuner runs (``tuning_context``); its file cache
lies beside mxgemm's tuning file and is loaded when a weight is prepared, so a restart replays the tactics.
Activations are quantized by mxgemm's own Triton kernel (:mod:`mxgemm.kernels.mx_quant`), never by FlashInfer's
``mxfp8_quantize``, whose kernel is compiled for SM100+ only and silently does nothing elsewhere.

``flashinfer_cudnn`` runs FlashInfer's cuDNN GEMMs (they need cuDNN's Python frontend, ``nvidia-cudnn-frontend``),
and also the experts of a mixture of experts, through FlashInfer's ``grouped_mm_mxfp8``: each expert's weight rows
padded to a multiple of 128 and its scales swizzled 128x4 once; per call, the rows quantized to MXFP8 and laid out
as FlashInfer's own MoE runner lays them out for cuDNN, which reads block scales in 128-row tiles: each expert's rows
padded to a multiple of 128, the experts one after another from row 0 (``m_indptr`` their starts, then the end), in
a buffer sized by the row count and E alone (no host synchronisation), whose scales are swizzled 128x4 as one matrix;
cuDNN runs the last expert to the buffer's end (over zero rows), and the rows are read back from their places.

These backends have not been run on Blackwell by this project: no such GPU has been available to it.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import ClassVar

import torch

from ..device import DeviceInfo
from ..format import BLOCK_SIZE, e8m0_bytes
from ..layouts import finish_output, from_128x4, pad_rows, padded_groups, place_rows, to_128x4
from ..recipes import MX_ACT_SCALE_MODE, Recipe
from .base import Availability, Backend, PreparedGroupedWeight, PreparedWeight, UnsupportedWeightError
from .capabilities import GroupedWeights

__all__ = ["FlashInferCuDNN", "FlashInferCuteDSL", "FlashInferCutlass", "FlashInferTRTLLM"]

TRTLLM_TILE = 128
CUDNN_SEGMENT = 128  # cuDNN's grouped GEMM reads block scales in 128-row tiles: experts' rows and weight rows padded
N_MULTIPLE = 32  # cutlass / cute-dsl weight rows: bf16 output rows 16-byte aligned, and SM12x's N % 32
WARM_UP_ON = ("cuda",)  # device types whose first prepare runs one GEMM (FlashInfer's kernels need a GPU)
_WARMED: set[tuple[str, torch.device]] = set()


def _flashinfer():
    import flashinfer

    return flashinfer


class _FlashInferMX(Backend):
    recipes = (Recipe.W8A8_MX,)
    tunable = True  # by FlashInfer's own autotuner, switched on while mxgemm's tuner runs (tuning_context)
    fi_backend: ClassVar[str]

    def tuning_context(self, weight: PreparedWeight):
        """FlashInfer's autotuner on, with its file cache beside mxgemm's tuning file (:func:`tactics_path`): it loads
        that file on entry and saves what it profiled on exit."""
        return _flashinfer().autotuner.autotune(True, cache=str(tactics_path(weight.device)))

    def check_device(self, device: DeviceInfo) -> Availability:
        if importlib.util.find_spec("flashinfer") is None:
            return Availability(
                False, "the 'flashinfer-python' package is not installed (pip install 'mxgemm[flashinfer]')"
            )
        if device.type != "cuda" or device.sm is None:
            return Availability(False, f"needs a CUDA GPU; this device is {device.type}")
        try:
            supported = _flashinfer().mm_mxfp8.is_backend_supported(self.fi_backend, device.sm)
        except Exception as exc:  # FlashInfer's own error is the reason
            return Availability(False, f"FlashInfer could not answer for '{self.fi_backend}': {exc}")
        if not supported:
            return Availability(
                False,
                f"FlashInfer says mm_mxfp8 backend '{self.fi_backend}' does not support compute capability {device.sm}",
            )
        return Availability(True, f"FlashInfer mm_mxfp8 '{self.fi_backend}' on SM{device.sm}; {_kernels_origin()}")

    def check_problem(self, out_features: int, in_features: int) -> Availability:
        if out_features < 128 or in_features < 128:
            return Availability(
                False, f"FlashInfer mm_mxfp8 needs N >= 128 and K >= 128, got N={out_features}, K={in_features}"
            )
        return Availability(True, "shape fits")

    def prepare(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedWeight:
        """The backend's tensors (:meth:`_tensors`); then FlashInfer's tuned tactics for this device are loaded, and
        its kernels built, at load time rather than in the first forward (:meth:`_warm_up`)."""
        if qdata.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{self.name} takes E4M3 weights; got {qdata.dtype}")
        n, k = qdata.shape
        weight = PreparedWeight(self.name, recipe, n, k, self._tensors(qdata, scale))
        load_tactics(qdata.device)
        self._warm_up(weight)
        return weight

    def _tensors(self, qdata: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = pad_rows(qdata, scale, N_MULTIPLE)
        return {"qdata": q.contiguous(), "scale": to_128x4(s)}

    def _warm_up(self, weight: PreparedWeight) -> None:
        """FlashInfer builds a backend's kernels at its first GEMM (with nvcc; trtllm downloads kernel binaries): one
        GEMM of one row here, once per backend and device, moves that (and mxgemm's activation quantizer's compile)
        to load time."""
        key = (self.name, weight.device)
        if weight.device.type not in WARM_UP_ON or key in _WARMED:
            return
        self.run(torch.zeros(1, weight.in_features, dtype=torch.bfloat16, device=weight.device), weight, None)
        _WARMED.add(key)

    def _mm(self, xq, xs, weight: PreparedWeight) -> torch.Tensor:
        t = weight.tensors
        return _flashinfer().mm_mxfp8(
            xq, t["qdata"].t(), xs, t["scale"], out_dtype=torch.bfloat16, backend=self.fi_backend
        )

    def run(self, x: torch.Tensor, weight: PreparedWeight, bias: torch.Tensor | None, tactic=None) -> torch.Tensor:
        from ..kernels.mx_quant import mx_quantize

        xq, xs = mx_quantize(x, scale_mode=MX_ACT_SCALE_MODE, layout=self.act_layout)
        return finish_output(self._mm(xq, xs, weight), x, bias, weight.out_features)

    def export_mx(self, weight: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = weight.out_features, weight.in_features
        return weight.tensors["qdata"][:n], from_128x4(weight.tensors["scale"], n, k // BLOCK_SIZE)

    act_layout: ClassVar[str] = "128x4"


class FlashInferCutlass(_FlashInferMX):
    name = "flashinfer_cutlass"
    fi_backend = "cutlass"
    summary = "FlashInfer CUTLASS MXFP8 GEMM (Blackwell block-scaled tensor cores)"


class FlashInferCuteDSL(_FlashInferMX):
    name = "flashinfer_cutedsl"
    fi_backend = "cute-dsl"
    summary = "FlashInfer CuTe-DSL MXFP8 GEMM (Blackwell block-scaled tensor cores)"


class FlashInferTRTLLM(_FlashInferMX):
    name = "flashinfer_trtllm"
    fi_backend = "trtllm"
    act_layout = "8x4"
    summary = "FlashInfer TRT-LLM MXFP8 GEMM: shuffled weights, 8x4 activation scales, bf16 output"

    def check_problem(self, out_features: int, in_features: int) -> Availability:
        answer = super().check_problem(out_features, in_features)
        if answer and in_features % 256:
            return Availability(False, f"flashinfer_trtllm needs K % 256 == 0, got K={in_features}")
        return answer

    def _tensors(self, qdata: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        fi = _flashinfer()
        q, s = pad_rows(qdata, scale, TRTLLM_TILE)
        q = fi.shuffle_matrix_a(q, TRTLLM_TILE)
        s = fi.shuffle_matrix_sf_a(s, TRTLLM_TILE, num_elts_per_sf=32).reshape(-1)
        return {"qdata": q.contiguous(), "scale": s.contiguous()}

    def _mm(self, xq, xs, weight: PreparedWeight) -> torch.Tensor:
        t = weight.tensors
        return _flashinfer().mm_mxfp8(
            xq,
            t["qdata"].t(),
            xs,
            t["scale"],
            out_dtype=torch.bfloat16,
            backend=self.fi_backend,
            use_8x4_sf_layout=True,
        )

    def export_mx(self, weight: PreparedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        """FlashInfer's shuffles undone: where each stored byte came from is found by running the same shuffles on
        the bytes of position indices (they move bytes and never look at them)."""
        fi, t = _flashinfer(), weight.tensors
        n, k = weight.out_features, weight.in_features
        np_ = t["qdata"].shape[0]
        rows = _source_positions(lambda b: fi.shuffle_matrix_a(b, TRTLLM_TILE), (np_, 1), t["qdata"].device)
        q = torch.empty_like(t["qdata"])
        q[rows] = t["qdata"]
        shape = (np_, k // BLOCK_SIZE)
        src = _source_positions(
            lambda b: fi.shuffle_matrix_sf_a(b, TRTLLM_TILE, num_elts_per_sf=BLOCK_SIZE), shape, t["scale"].device
        )
        kept = src >= 0
        s = torch.empty(shape[0] * shape[1], dtype=torch.uint8, device=t["scale"].device)
        s[src[kept]] = t["scale"].reshape(-1)[kept]
        return q[:n], s.reshape(shape)[:n]


@functools.cache  # installed packages do not change in a process; resolving each layer asks again
def _cudnn_frontend_missing() -> bool:
    """Whether cuDNN's Python frontend (``import cudnn``), which FlashInfer's cuDNN GEMMs build their graphs with, is
    not installed."""
    return importlib.util.find_spec("cudnn") is None


class FlashInferCuDNN(_FlashInferMX, GroupedWeights):
    name = "flashinfer_cudnn"
    fi_backend = "cudnn"
    grouped_recipes = (Recipe.W8A8_MX,)
    summary = "FlashInfer cuDNN MXFP8 GEMM, and grouped (experts) through grouped_mm_mxfp8"

    def check_device(self, device: DeviceInfo) -> Availability:
        answer = super().check_device(device)
        if answer and _cudnn_frontend_missing():
            return Availability(
                False, "FlashInfer's cuDNN GEMMs need cuDNN's Python frontend (pip install nvidia-cudnn-frontend)"
            )
        return answer

    def check_grouped(self, device: DeviceInfo) -> Availability:
        if not _flashinfer().grouped_mm.grouped_mm_mxfp8.is_compute_capability_supported(device.sm):
            return Availability(
                False, f"FlashInfer says grouped_mm_mxfp8 does not support compute capability {device.sm}"
            )
        return Availability(True, f"FlashInfer grouped_mm_mxfp8 (cuDNN) on SM{device.sm}")

    def prepare_grouped(self, qdata: torch.Tensor, scale: torch.Tensor, recipe: str) -> PreparedGroupedWeight:
        """The E4M3 experts with their rows padded to a multiple of 128, each expert's scales swizzled 128x4 (``[E,
        Np, K/32]``); refused where K is not a multiple of 128 (cuDNN's 128x4 scale tiles along K)."""
        e, n, k = qdata.shape
        if qdata.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{self.name} takes E4M3 weights; got {qdata.dtype}")
        if k % 128:
            raise UnsupportedWeightError(f"FlashInfer's grouped_mm_mxfp8 reads K in multiples of 128; K = {k}")
        padded = [pad_rows(qdata[i], e8m0_bytes(scale[i]), CUDNN_SEGMENT) for i in range(e)]
        q = torch.stack([p[0] for p in padded]).contiguous()
        s = torch.stack([to_128x4(p[1]).view(q.shape[1], k // BLOCK_SIZE) for p in padded])
        return PreparedGroupedWeight(self.name, recipe, n, k, {"qdata": q, "scale": s}, {}, experts=e)

    def run_grouped(self, x, weight, offsets, tactic=None) -> torch.Tensor:
        from ..kernels.mx_quant import mx_quantize

        rows, k = x.shape
        cols = k // BLOCK_SIZE
        dest, starts, padded = padded_groups(offsets, rows, CUDNN_SEGMENT)
        xq, xs = mx_quantize(x, scale_mode=MX_ACT_SCALE_MODE)
        # the rows and their scales in their padded places, zeros elsewhere
        aq = place_rows(xq.view(torch.uint8), dest, padded).view(torch.float8_e4m3fn)
        a_sf = to_128x4(place_rows(xs, dest, padded)).view(padded, cols)
        t = weight.tensors
        y = _flashinfer().grouped_mm.grouped_mm_mxfp8(
            aq, t["qdata"], a_sf, t["scale"], starts.to(torch.int32), out_dtype=x.dtype
        )
        y = y[dest.clamp(max=padded - 1), : weight.out_features]
        return y.masked_fill((dest == padded)[:, None], 0)  # the rows past the last expert's end

    def export_grouped_mx(self, weight: PreparedGroupedWeight) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = weight.tensors["qdata"], weight.tensors["scale"]
        n, k = weight.out_features, weight.in_features
        scales = [from_128x4(s[i].reshape(-1), q.shape[1], k // BLOCK_SIZE)[:n] for i in range(weight.experts)]
        return q[:, :n], torch.stack(scales)


def tactics_path(device: torch.device) -> Path:
    """Where FlashInfer's tuned tactics for this device persist: ``flashinfer-<mxgemm's tuning file name>`` beside
    that file (FlashInfer's own JSON format, with its environment metadata)."""
    from ..device import describe_device
    from ..tuning import default_cache_path

    path = default_cache_path(describe_device(device))
    return path.with_name(f"flashinfer-{path.name}")


@functools.cache
def _load_tactics_file(path: str) -> bool:
    from flashinfer.autotuner import AutoTuner

    return AutoTuner.get().load_configs(path)


def load_tactics(device: torch.device) -> bool:
    """Give FlashInfer's autotuner the tactics tuned on this device before (once per file and process), so that a
    restart replays them instead of running FlashInfer's fallback; False when there are none (or FlashInfer rejects
    the file: it checks its own version and the CUDA libraries' against the file's)."""
    path = tactics_path(device)
    return path.is_file() and _load_tactics_file(str(path))


@functools.cache  # installed packages do not change in a process; resolving each layer asks again
def _kernels_origin() -> str:
    """Where FlashInfer's kernels come from: its precompiled packages of the same version, when installed, else a JIT
    compile with nvcc (trtllm: a download of kernel binaries) when the backend first prepares a weight on a device."""
    from importlib import metadata

    try:
        version = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return "FlashInfer's version unknown"
    found = []
    for package in ("flashinfer-cubin", "flashinfer-jit-cache"):
        try:
            if metadata.version(package).split("+")[0] == version:
                found.append(package)
        except metadata.PackageNotFoundError:
            pass
    if found:
        return f"kernels precompiled ({', '.join(found)} {version})"
    return (
        f"kernels compiled when it first prepares a weight (no flashinfer-cubin / flashinfer-jit-cache {version} "
        "installed; trtllm downloads its kernel binaries)"
    )


def _source_positions(move, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """For ``move``, a function that only rearranges (and possibly zero-pads) the bytes of a uint8 tensor of
    ``shape``: the flat source index of each byte it returns, -1 for padding. Runs it on the four bytes of
    ``index + 1``, one byte plane at a time."""
    pos = torch.arange(1, shape[0] * shape[1] + 1, dtype=torch.int64, device=device)
    out = torch.zeros((), dtype=torch.int64, device=device)
    for b in range(4):
        plane = ((pos >> (8 * b)) & 0xFF).to(torch.uint8).reshape(shape)
        out = out + (move(plane).reshape(-1).to(torch.int64) << (8 * b))
    return out - 1
