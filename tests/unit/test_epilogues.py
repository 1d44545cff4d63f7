"""Output epilogues on paths only GPUs run, checked on CPU with stand-in GEMMs: the bias added exactly once (in the
kernel's epilogue when it is bf16, after it otherwise), padded outputs sliced back to N, fp16 callers answered in
fp16."""

import pytest
import torch
from helpers import random_act

import mxgemm
from mxgemm.backends import hybrid_sm90
from mxgemm.backends.base import PreparedWeight
from mxgemm.backends.hybrid_sm90 import HybridSM90Backend
from mxgemm.kernels import Launch, cublaslt, fp8_gemm

N, K = 200, 512  # N padded to 208 for the kernels and cuBLASLt


def _weight(crossover: int) -> PreparedWeight:
    tensors = {"qdata": torch.zeros(208, 512, dtype=torch.float8_e4m3fn), "block_scale": torch.ones(2, 4)}
    info = {"crossover": crossover, "small_m": True, "fp8_sms": 132}
    return PreparedWeight("hybrid_sm90", "hybrid-block128", N, K, tensors, info)


class _StandIn:
    """A kernel launch that writes known bf16 values, adds the bias it is handed, and records that bias."""

    def __init__(self):
        self.biases = []

    def plan(self, *args, **kwargs):
        def launch(x, bias):
            self.biases.append(bias)
            y = (torch.arange(x.shape[0] * N, dtype=torch.float32).reshape(x.shape[0], N) / 7).bfloat16()
            return y if bias is None else (y.float() + bias.float()).bfloat16()

        return Launch(launch, gated=Launch(lambda gate, up, bias: launch(gate, bias)))  # no C entry: the launcher runs


@pytest.mark.parametrize("path", ["small_m", "fp8"])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_kernel_paths_add_the_bias_once(monkeypatch, path, bias_dtype, x_dtype):
    kernel = _StandIn()
    monkeypatch.setattr(hybrid_sm90, "small_m_plan", kernel.plan)
    monkeypatch.setattr(fp8_gemm, "linear_plan", kernel.plan)
    monkeypatch.setattr("mxgemm.kernels.w8a16.w8a16_linear", lambda *a, **k: pytest.fail("the Triton kernel ran"))
    m = 5
    if path == "small_m" and x_dtype == torch.float16:
        pytest.skip("the CUDA small-M kernel takes bf16 activations; fp16 ones go to Triton")
    weight = _weight(crossover=1 if path == "fp8" else 17)
    x = random_act(m, K, dtype=x_dtype)
    bias = None if bias_dtype is None else torch.randn(N).to(bias_dtype)
    y = HybridSM90Backend().run(x, weight, bias)
    plain = (torch.arange(m * N, dtype=torch.float32).reshape(m, N) / 7).bfloat16()
    if bias is None:
        expected = plain
    elif bias_dtype == torch.bfloat16:  # in the epilogue: one rounding
        expected = (plain.float() + bias.float()).bfloat16()
    else:  # added after the kernel, in bf16
        expected = plain + bias.to(torch.bfloat16)
    assert y.dtype == x_dtype and y.shape == (m, N)
    assert torch.equal(y, expected.to(x_dtype))
    assert kernel.biases == [bias if bias_dtype == torch.bfloat16 else None]


@pytest.mark.parametrize("with_bias", [False, True])
def test_cublas_path_slices_the_padded_output_and_adds_the_bias(monkeypatch, with_bias):
    """cuBLASLt writes [Mp, Np] (M padded to 4, N to 16): the caller gets [M, N] plus the bias."""
    m = 3
    padded = torch.randn(4, 208).bfloat16()

    def quantize(x):
        return torch.zeros(4, 512, dtype=torch.float8_e4m3fn), torch.ones(4, 4).t().contiguous().t()

    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        assert a.shape == (4, 512) and b.shape == (512, 208) and out_dtype == torch.bfloat16
        return padded

    monkeypatch.setattr(cublaslt.torch, "_scaled_mm", scaled_mm)
    bias = torch.randn(N).bfloat16() if with_bias else None
    t = _weight(1).tensors
    y = cublaslt.blockwise_linear(random_act(m, K), t["qdata"], t["block_scale"], N, bias, quantize=quantize)
    expected = padded[:m, :N] + (bias if with_bias else 0)
    assert y.shape == (m, N) and y.is_contiguous() and torch.equal(y, expected)


def test_flashinfer_trtllm_output_is_sliced_back_to_n(monkeypatch):
    """trtllm pads N to 128: its [M, 256] output comes back as [M, 200] with the bias."""
    import sys
    import types

    from helpers import random_mx_weight

    from mxgemm.backends.flashinfer_mx import FlashInferTRTLLM

    out = torch.randn(3, 256).bfloat16()
    fi = types.SimpleNamespace(
        shuffle_matrix_a=lambda t, tile: t,
        shuffle_matrix_sf_a=lambda t, tile, num_elts_per_sf=16: mxgemm.layouts.to_128x4(t),
        mm_mxfp8=lambda *a, **k: out,
    )
    monkeypatch.setitem(sys.modules, "flashinfer", fi)
    monkeypatch.setattr("mxgemm.kernels.mx_quant.mx_quantize", lambda x, **k: (x, None))
    q, s = random_mx_weight(N, K)
    backend = FlashInferTRTLLM()
    weight = backend.prepare(q, s, "w8a8-mx")
    bias = torch.randn(N).bfloat16()
    y = backend.run(random_act(3, K), weight, bias)
    assert y.shape == (3, N) and torch.equal(y, out[:, :N] + bias)


def test_the_cublas_path_shares_its_quantized_rows(monkeypatch):
    """Without planned calls: ``run_sharing`` answers on the cuBLAS path only (above M = 256 by default here), with the
    CUDA quantizer's rows, and ``run_quantized`` runs ``torch._scaled_mm`` on exactly those rows."""
    rows, seen = object(), []
    monkeypatch.setattr(fp8_gemm, "quantize_1x128", lambda x: rows)
    monkeypatch.setattr(
        hybrid_sm90,
        "blockwise_linear",
        lambda x, qd, bs, n, bias, quantize: seen.append((qd, bs, n, bias, quantize(x))) or x,
    )
    weight, backend = _weight(crossover=17), HybridSM90Backend()
    bias = torch.randn(N).bfloat16()
    for m in (8, 64):  # the small-M kernel; the FP8 kernel, which quantizes in its own launch
        assert backend.run_sharing(random_act(m, K), weight, bias) is None
    x = random_act(300, K)
    assert backend.run_sharing(x, weight, bias) == (x, rows)
    assert backend.run_quantized(x, rows, weight, None) is x
    t = weight.tensors
    assert seen == [(t["qdata"], t["block_scale"], N, b, rows) for b in (bias, None)]


def test_planned_calls_share_the_rows_their_buffer_holds(monkeypatch):
    """Where planned cuBLASLt calls run, ``run_sharing`` is the weight's planned call for that M (``.sharing``: its
    output and the rows it quantized) and ``run_quantized`` that plan's GEMM alone on them, each plan made once per
    weight and M beside its plans; never ``torch._scaled_mm``. Rows of the other route (a member whose plan cuBLASLt
    refused) are not read: the call quantizes its input itself."""
    made, runs = [], []

    def linear_plan(qd, bs, n, k, m, x_dtype):
        made.append((qd, bs, n, k, m, x_dtype))
        return Launch(
            lambda x, bias: runs.append(("own call", m, bias)) or x,
            sharing=lambda x, bias: runs.append(("sharing", m, bias)) or (x, shared_rows(m)),
            on_quantized=lambda rows, x, bias: runs.append(("gemm", rows, bias)) or x,
        )

    def shared_rows(m):
        return hybrid_sm90.cublaslt.PlannedRows("the first call's buffer", 1, 2, m, K)

    monkeypatch.setattr(hybrid_sm90.cublaslt, "linear_plan", linear_plan)
    monkeypatch.setattr(hybrid_sm90, "blockwise_linear", lambda *a, **k: pytest.fail("not through _scaled_mm"))
    weight, backend = _weight(crossover=17), HybridSM90Backend()
    weight.info["blockwise_plan"] = True
    bias = torch.randn(N).bfloat16()
    for m in (300, 512):
        x = random_act(m, K)
        y, rows = backend.run_sharing(x, weight, bias)
        assert y is x and rows == shared_rows(m)
        assert backend.run_quantized(x, rows, weight, None) is x
    assert runs == [
        ("sharing", 300, bias),
        ("gemm", shared_rows(300), None),
        ("sharing", 512, bias),
        ("gemm", shared_rows(512), None),
    ]
    t = weight.tensors
    assert made == [(t["qdata"], t["block_scale"], N, K, m, torch.bfloat16) for m in (300, 512)]
    x = random_act(512, K)
    assert backend.run_quantized(x, ("the quantizer's", "rows"), weight, bias) is x  # from a member without a plan
    assert runs[-1] == ("own call", 512, bias)


def test_a_member_without_a_plan_quantizes_rows_shared_by_a_planned_one_itself(monkeypatch):
    """Rows a planned call shared reach a weight whose plan cuBLASLt refused: it quantizes its input itself and runs
    ``torch._scaled_mm`` on that, the same numerics."""
    own, seen = object(), []
    monkeypatch.setattr(fp8_gemm, "quantize_1x128", lambda x: own)
    monkeypatch.setattr(
        hybrid_sm90, "blockwise_linear", lambda x, qd, bs, n, bias, quantize: seen.append(quantize(x)) or x
    )
    weight, backend = _weight(crossover=17), HybridSM90Backend()  # no planned calls here
    x = random_act(300, K)
    planned_rows = hybrid_sm90.cublaslt.PlannedRows("a planned call's", 1, 2, 304, K)
    assert backend.run_quantized(x, planned_rows, weight, None) is x
    assert seen == [own]
