"""mxgemm's FlashInfer backends against the real `flashinfer-python` (pinned in the dev extras), on CPU.

Each backend runs through FlashInfer's real entry points: `mm_mxfp8.is_backend_supported`, `mm_mxfp8` with its
argument checks and per-backend requirements, its backend selection and its autotuner's choice, and (trtllm)
`shuffle_matrix_a` / `shuffle_matrix_sf_a`. Stubbed are only what needs a GPU: the device queries (the pretended
compute capability), the compiled-module loads, and the final kernel launch, whose stand-in computes what FlashInfer
documents from the operands it receives (a [M, K] and b [K, N] E4M3 with 1-D 128x4-swizzled E8M0 scales; trtllm: b's
rows and scales shuffled, a's scales 8x4 when asked), so a call that passed anything else would give other numbers
than mxgemm's emulated twin. `flashinfer_cudnn`'s experts go through the real `grouped_mm_mxfp8` (its checks and
table); stubbed are the device query, cuDNN's version check and the launch, whose stand-in computes what FlashInfer
documents and its MoE runner keeps to (a [cum_m, K] E4M3 with [cum_m, K/32] scales swizzled 128x4 as one matrix, b
[E, N, K] with each expert's scales swizzled 128x4, every expert's rows starting at a multiple of 128 since cuDNN
reads block scales in 128-row tiles, the last expert's running to cum_m).
"""

import sys
import types
from typing import ClassVar

import pytest
import torch
from helpers import random_act, random_mx_weight

import mxgemm
from mxgemm import layouts
from mxgemm.backends import flashinfer_mx
from mxgemm.device import DeviceInfo

flashinfer = pytest.importorskip("flashinfer")
gemm_base = pytest.importorskip("flashinfer.gemm.gemm_base")
grouped_core = pytest.importorskip("flashinfer.grouped_mm.core")
fi_utils = pytest.importorskip("flashinfer.utils")
from flashinfer.autotuner import TunableRunner  # noqa: E402


def _unshuffle_rows(shuffled: torch.Tensor, rows: int) -> torch.Tensor:
    """Undo FlashInfer's shuffle_matrix_a (epilogue tile 128) by its own row indices."""
    order = flashinfer.shuffle_matrix_a(torch.arange(rows, dtype=torch.int32).unsqueeze(1), 128).squeeze(1).long()
    out = torch.empty_like(shuffled)
    out[order] = shuffled
    return out


class _Launch(TunableRunner):
    """The kernel launch's stand-in: out = dequant(a) @ dequant(b), reading the operands as FlashInfer documents."""

    calls: ClassVar[list] = []

    def __init__(self, backend: str, use_8x4: bool = False):
        self.backend, self.use_8x4 = backend, use_8x4

    def get_valid_tactics(self, inputs, profile):
        return [-1]

    def forward(self, inputs, tactic=-1, **kwargs):
        a, b, a_sf, b_sf, out_dtype, out, _workspace = inputs
        m, k = a.shape
        n = b.shape[1]
        assert b.stride() == (1, k), "b must be the transpose of a row-major [N, K] weight"
        cols = k // 32
        a_rows = layouts.from_8x4(a_sf, m, cols) if self.use_8x4 else layouts.from_128x4(a_sf, m, cols)
        if self.backend == "trtllm":  # b's rows and scale rows shuffled for epilogue tile 128
            w = _unshuffle_rows(b.t().contiguous().view(torch.uint8), n).view(torch.float8_e4m3fn)
            b_rows = _unshuffle_rows(layouts.from_128x4(b_sf, n, cols), n)
        else:
            w, b_rows = b.t(), layouts.from_128x4(b_sf, n, cols)
        if self.backend != "trtllm":  # CUTLASS / CuTe-DSL store bf16 output rows 16-byte aligned
            assert out.stride(0) * out.element_size() % 16 == 0, f"output rows of {n} bf16 are not 16-byte aligned"
        _Launch.calls.append((self.backend, m, n, k, self.use_8x4))
        out.copy_((_dequant(a, a_rows) @ _dequant(w, b_rows).t()).to(out_dtype))


def _dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return mxgemm.dequantize(mxgemm.MXTensor(q.contiguous(), s))


def _grouped_launch(a, b, a_descale, b_descale, m_indptr, out_dtype=torch.bfloat16, out=None, tactic=-1):
    """The cuDNN grouped launch's stand-in: each expert's rows times its weight, reading the operands as FlashInfer
    documents (module docstring); FlashInfer hands cuDNN the experts' starts, so the last expert runs to cum_m."""
    cum_m, k = a.shape
    experts, n, _ = b.shape
    cols = k // 32
    assert cum_m % 128 == 0 and n % 128 == 0 and cols % 4 == 0, (cum_m, n, k)
    assert a_descale.shape == (cum_m, cols) and b_descale.shape == (experts, n, cols)
    starts = m_indptr[:-1].tolist()
    assert all(start % 128 == 0 for start in starts), f"an expert's rows start inside a 128-row tile: {starts}"
    a_rows = layouts.from_128x4(a_descale.reshape(-1), cum_m, cols)
    out = torch.zeros(cum_m, n, dtype=out_dtype) if out is None else out
    for e, (lo, hi) in enumerate(zip(starts, [*starts[1:], cum_m], strict=True)):
        if hi > lo:
            w = _dequant(b[e], layouts.from_128x4(b_descale[e].reshape(-1), n, cols))
            out[lo:hi] = (_dequant(a[lo:hi], a_rows[lo:hi]) @ w.t()).to(out_dtype)
    _Launch.calls.append(("cudnn-grouped", cum_m, n, k, False))
    return out


@pytest.fixture(params=[(10, 0), (12, 0)], ids=["sm100", "sm120"])
def pretend(request, monkeypatch):
    """FlashInfer on CPU tensors as if on a GPU of this compute capability."""
    cc = request.param
    for module in (fi_utils, gemm_base):
        if hasattr(module, "get_compute_capability"):
            monkeypatch.setattr(module, "get_compute_capability", lambda device: cc)
    monkeypatch.setattr(gemm_base, "is_sm12x_supported", lambda device: cc[0] == 12)
    monkeypatch.setattr(gemm_base, "_check_cute_dsl_availability", lambda: None)
    monkeypatch.setattr(gemm_base, "_check_cute_dsl_arch", lambda device: None)
    monkeypatch.setattr(gemm_base, "_get_stream_cache_buf", lambda name, size, device, zero_init=False: torch.empty(0))
    cutlass = types.SimpleNamespace(cutlass_mxfp8_gemm_runner=lambda: _Launch("cutlass"))
    monkeypatch.setattr(gemm_base, "get_cutlass_mxfp8_gemm_module", lambda major: cutlass)
    trtllm = types.SimpleNamespace(trtllm_mxfp8_gemm_runner=lambda use_8x4: _Launch("trtllm", use_8x4))
    monkeypatch.setattr(gemm_base, "get_trtllm_gemm_module", lambda: trtllm)
    monkeypatch.setattr(gemm_base, "_use_sm107_mxfp8_cute_dsl", lambda *args: False)
    monkeypatch.setattr(gemm_base, "_cute_dsl_mxfp8_runners", lambda *args: [_Launch("cute-dsl")])
    monkeypatch.setattr(gemm_base, "_cudnn_mm_mxfp8_runner", lambda: _Launch("cudnn"))
    monkeypatch.setattr(gemm_base, "_cudnn_available_or_raise_for_backend", lambda backend: True)
    monkeypatch.setattr(grouped_core, "get_compute_capability", lambda device: cc)
    monkeypatch.setattr(grouped_core, "_check_cudnn_version", lambda min_version, feature: None)
    monkeypatch.setattr(grouped_core, "_run_cudnn_moe_block_scale_grouped_gemm_mxfp8", _grouped_launch)
    monkeypatch.setattr(flashinfer_mx, "_cudnn_frontend_missing", lambda: False)
    # shuffle_matrix_sf_a's 128x4 re-interleave is a compiled op: the documented layout in its place
    quantization = sys.modules[flashinfer.shuffle_matrix_sf_a.__module__]
    monkeypatch.setattr(quantization, "block_scale_interleave", lambda t: layouts.to_128x4(t.view(torch.uint8)))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # mxgemm's activation quantizer runs in Triton's interpreter
    _Launch.calls = []
    return DeviceInfo(type="cuda", name="pretend", capability=cc, index=0)


# FlashInfer 0.7.4's table (gemm_base's @supported_compute_capability on each mm_mxfp8 requirement; cudnn-grouped:
# grouped_mm_mxfp8's)
BLACKWELL = {100, 103, 107, 110, 120, 121}
REAL_TABLE = {"cute-dsl": {100, 103, 107}, "trtllm": {100, 103, 107}, "cutlass": BLACKWELL, "cudnn": BLACKWELL}
FI_NAMES = {
    "flashinfer_cutedsl": "cute-dsl",
    "flashinfer_cutlass": "cutlass",
    "flashinfer_trtllm": "trtllm",
    "flashinfer_cudnn": "cudnn",
}


@pytest.mark.parametrize("cc", [90, 100, 103, 107, 110, 120, 121])
def test_availability_is_flashinfers_own_table(cc, monkeypatch):
    monkeypatch.setattr(flashinfer_mx, "_cudnn_frontend_missing", lambda: False)
    device = DeviceInfo(type="cuda", name="pretend", capability=divmod(cc, 10), index=0)
    for name, fi_name in FI_NAMES.items():
        assert bool(mxgemm.backends.get_backend(name).check_device(device)) == (cc in REAL_TABLE[fi_name]), (name, cc)
    cudnn = mxgemm.backends.get_backend("flashinfer_cudnn")
    assert bool(cudnn.check_grouped(device)) == (cc in BLACKWELL), cc
    # MX experts under auto: PyTorch's grouped GEMM first (its cuBLAS probe needs a real GPU: refused here), then this
    grouped = mxgemm.explain_auto(device, recipe="w8a8-mx", shape=(256, 512), grouped=True)
    assert (grouped.backend.name == "flashinfer_cudnn") == (cc in BLACKWELL), (cc, grouped.backend.name)
    assert "cublas_mx" in dict(grouped.skipped)


def test_cudnn_needs_its_python_frontend(monkeypatch):
    monkeypatch.setattr(flashinfer_mx, "_cudnn_frontend_missing", lambda: True)
    device = DeviceInfo(type="cuda", name="pretend", capability=(10, 0), index=0)
    answer = mxgemm.backends.get_backend("flashinfer_cudnn").check_device(device)
    assert not answer and "pip install nvidia-cudnn-frontend" in answer.reason


@pytest.mark.parametrize("n", [256, 130, 136])
@pytest.mark.parametrize("name", list(FI_NAMES))
def test_each_backend_through_flashinfer_matches_the_twin(pretend, name, n):
    backend = mxgemm.backends.get_backend(name)
    if not backend.check_device(pretend):
        pytest.skip(f"{name} is not FlashInfer's on SM{pretend.sm}")
    k, m = 512, 5
    q, s = random_mx_weight(n, k, seed=n)
    x = random_act(m, k, seed=7)
    w = backend.prepare(q, s, "w8a8-mx")
    y = backend.run(x, w, None)
    twin = mxgemm.backends.get_backend("emulation")
    ref = twin.run(x, twin.prepare(q, s, "w8a8-mx"), None)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    # both round an fp32 product to bf16 once: equal but for the fp32 summation order (within 1 bf16 ulp)
    assert torch.allclose(y.float(), ref.float(), rtol=2**-7, atol=0), (y - ref).abs().max()
    assert (y != ref).float().mean() < 0.01
    assert _Launch.calls[-1][0] == FI_NAMES[name] and _Launch.calls[-1][4] == (name == "flashinfer_trtllm")
    exported_q, exported_s = backend.export_mx(w)
    assert torch.equal(exported_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(exported_s, s)


@pytest.mark.parametrize(
    ("n", "counts"),
    [(256, [3, 0, 137, 10]), (130, [0, 0, 150, 0]), (384, [1, 1, 1, 1])],
    ids=["uneven", "one-expert", "one-row-each"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_experts_through_flashinfers_grouped_gemm_match_the_twin(pretend, n, counts, dtype):
    """Uneven rows over 4 experts (empty ones, all on one, one each; N 130 padded to 256) and 5 rows past the last
    expert's end: what FlashInfer's cuDNN grouped GEMM answers for the padded layout, read back, is the twin's."""
    backend = mxgemm.backends.get_backend("flashinfer_cudnn")
    assert backend.check_grouped(pretend)
    experts, k = len(counts), 256
    q, s = random_mx_weight(experts * n, k, seed=n)
    q, s = q.view(experts, n, k), s.view(experts, n, k // 32)
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    x = random_act(int(offsets[-1]) + 5, k, seed=3, dtype=dtype)
    weight = backend.prepare_grouped(q, s, "w8a8-mx")
    y = backend.run_grouped(x, weight, offsets)
    twin = mxgemm.backends.get_backend("emulation")
    ref = twin.run_grouped(x, twin.prepare_grouped(q, s, "w8a8-mx"), offsets)
    assert y.shape == (x.shape[0], n) and y.dtype == x.dtype
    assert torch.equal(y[int(offsets[-1]) :], torch.zeros_like(y[int(offsets[-1]) :]))
    # both round an fp32 product to x's dtype once: equal but for the fp32 summation order (within 1 ulp)
    assert torch.allclose(y.float(), ref.float(), rtol=torch.finfo(dtype).eps, atol=0), (y - ref).abs().max()
    assert (y != ref).float().mean() < 0.01
    assert _Launch.calls[-1][:3] == ("cudnn-grouped", 128 * ((x.shape[0] + 127) // 128 + experts), 128 * -(-n // 128))
    exported_q, exported_s = backend.export_grouped_mx(weight)
    assert torch.equal(exported_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(exported_s, s)


def test_grouped_weights_with_k_off_128_are_refused():
    q, s = random_mx_weight(2 * 128, 96)
    backend = mxgemm.backends.get_backend("flashinfer_cudnn")
    with pytest.raises(mxgemm.backends.UnsupportedWeightError, match="multiples of 128; K = 96"):
        backend.prepare_grouped(q.view(2, 128, 96), s.view(2, 128, 3), "w8a8-mx")


def test_info_says_where_the_kernels_come_from():
    """Without FlashInfer's precompiled packages of its version (none exist for 0.7.4 on the index), the reason says
    the kernels compile when the backend first prepares a weight (trtllm downloads)."""
    device = DeviceInfo(type="cuda", name="pretend", capability=(10, 0), index=0)
    reason = mxgemm.backends.get_backend("flashinfer_cutlass").check_device(device).reason
    assert "kernels compiled when it first prepares a weight (no flashinfer-cubin / flashinfer-jit-cache " in reason
    assert flashinfer.__version__ in reason


def test_flashinfers_tactics_persist_beside_mxgemms_tuning_file(monkeypatch, tmp_path):
    """mxgemm's tuner runs FlashInfer's autotuner with its file cache beside mxgemm's tuning file; preparing a weight
    later (a restart) loads that file into FlashInfer's autotuner, once per process."""
    import flashinfer.autotuner as fi_autotuner

    from mxgemm.backends import flashinfer_mx

    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    flashinfer_mx._load_tactics_file.cache_clear()
    backend = mxgemm.backends.get_backend("flashinfer_cutlass")
    q, s = random_mx_weight(256, 512)
    weight = backend.prepare(q, s, "w8a8-mx")
    path = flashinfer_mx.tactics_path(weight.device)
    assert path.parent == tmp_path and path.name.startswith("flashinfer-tuning-cpu-") and not path.exists()
    asked = []
    real_autotune = fi_autotuner.autotune
    monkeypatch.setattr(fi_autotuner, "autotune", lambda *a, **k: asked.append(k) or real_autotune(*a, **k))
    with backend.tuning_context(weight):
        assert fi_autotuner.AutoTuner.get().is_tuning_mode
    assert asked == [{"cache": str(path)}] or asked[0]["cache"] == str(path)
    fi_autotuner.AutoTuner.get().save_configs(str(path))  # what FlashInfer writes after profiling on a GPU
    loaded = []
    real_load = fi_autotuner.AutoTuner.load_configs
    monkeypatch.setattr(fi_autotuner.AutoTuner, "load_configs", lambda self, p: loaded.append(p) or real_load(self, p))
    backend.prepare(q, s, "w8a8-mx")
    backend.prepare(q, s, "w8a8-mx")
    assert loaded == [str(path)]


@pytest.mark.parametrize("name", ["flashinfer_cutlass", "flashinfer_trtllm"])
def test_preparation_builds_the_kernels_not_the_first_forward(pretend, monkeypatch, name):
    """On a GPU (here: the pretended device, its tensors on the CPU) the first prepare of a backend runs one GEMM of
    one row through FlashInfer, where its kernels are built; later prepares on that device do not."""
    from mxgemm.backends import flashinfer_mx

    backend = mxgemm.backends.get_backend(name)
    if not backend.check_device(pretend):
        pytest.skip(f"{name} is not FlashInfer's on SM{pretend.sm}")
    monkeypatch.setattr(flashinfer_mx, "WARM_UP_ON", ("cpu",))
    monkeypatch.setattr(flashinfer_mx, "_WARMED", set())
    q, s = random_mx_weight(256, 512)
    backend.prepare(q, s, "w8a8-mx")
    assert [call[:2] for call in _Launch.calls] == [(backend.fi_backend, 1)]
    backend.prepare(q, s, "w8a8-mx")
    assert len(_Launch.calls) == 1
