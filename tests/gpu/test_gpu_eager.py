"""The eager call path on the H200: the CUDA 1x128 quantizer bit for bit, launch plans equal to the op, bias added in
the kernels' epilogue, and one copy of the weight per layer."""

import pytest
import torch
from helpers import (
    FP8_TENSOR_CORE_SUMS,
    FP32_SUMS,
    assert_within_ulp,
    exact_product,
    hybrid_operands,
    kernels_launched,
    poison_cuda_allocator,
    random_act,
    random_mx_weight,
    skip_unless_backend_runs,
)

import mxgemm
from mxgemm import tuning
from mxgemm.backends.hybrid_sm90 import HybridSM90Backend, Path
from mxgemm.block128 import quantize_1x128, reencode_block128
from mxgemm.kernels import NO_BIAS
from mxgemm.ops import linear_op

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _hybrid_runs_here():
    skip_unless_backend_runs("hybrid_sm90")
    from mxgemm.kernels import fp8_gemm

    if not fp8_gemm.fp8_gemm_status(torch.cuda.get_device_capability()):
        pytest.skip("the FP8 kernel is not built here")


@pytest.mark.parametrize(
    "m,k,rows",
    [(1, 96, 1), (3, 4160, 1), (5, 128, 64), (64, 14336, 64), (72, 4096, 128), (2048, 4096, 1), (2048, 4160, 1)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows_apart", [0, 34])  # dense rows; rows 34 elements further apart (not 8-byte aligned)
def test_cuda_quantizer_bit_exact(m, k, rows, dtype, rows_apart):
    """Both quantizer shapes (one K group a warp; four a warp from two waves of blocks, as at M = 2048) give the
    reference's bits, on aligned rows and on rows their vector loads cannot take."""
    from mxgemm.kernels.fp8_gemm import quantize_1x128 as cuda_quantize

    x = (random_act(m, k + rows_apart, dtype=dtype, device="cuda") * 5)[:, :k]
    x[0, :7] = 0.0
    if m > 2:
        x[2] = 0.0  # an all-zero row
    q, s = cuda_quantize(x, rows)
    rq, rs = quantize_1x128(x)
    kb = rs.shape[1]
    assert q.shape[0] % max(rows, 4) == 0 and q.shape[1] % 512 == 0 and s.stride() == (1, q.shape[0])
    assert torch.equal(q[:m, :k].view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s[:m, :kb], rs)
    assert int(q[m:].view(torch.uint8).sum()) == 0 and int(q[:, k:].view(torch.uint8).sum()) == 0
    pad = s[m:]
    assert torch.equal(pad, torch.full_like(pad, 2.0**-64 / 448))  # zero rows: the floored amax's scale


@pytest.mark.parametrize("m", [1, 3, 16, 17, 33, 64, 100, 256, 1000])
@pytest.mark.parametrize("n,k", [(4160, 4160), (28672, 4096), (130, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_eager_plan_equals_op_and_twin(m, n, k, with_bias):
    """The eager path (a launch plan, bias in the epilogue) gives bit for bit what the compiled op gives, and
    matches the twin of its regime plus the bias."""
    q, s = random_mx_weight(n, k, seed=m + n, device="cuda")
    x = random_act(m, k, seed=k + m, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    y = mxgemm.linear(x, w, bias)
    assert w.plans, "the eager call ran through a plan"
    via_op = linear_op(x, w.op_tensors, bias, w.backend, w.op_meta)
    assert torch.equal(y, via_op)
    quantized = m >= w.info["crossover"]
    sums = FP8_TENSOR_CORE_SUMS if quantized else FP32_SUMS
    operands = hybrid_operands(x, q, s, quantized=quantized)
    if with_bias and HybridSM90Backend().choose(m, w).path == Path.CUBLAS:  # bf16 output, then the bias in bf16
        plain = mxgemm.linear(x, w)
        assert_within_ulp(plain, exact_product(*operands), sums=sums)
        assert torch.equal(y, plain + bias)
    else:  # the bias in the kernel's epilogue: one rounding
        assert_within_ulp(y, exact_product(*operands, bias), sums=sums)


def test_fp16_and_strided_inputs_and_fp32_bias():
    q, s = random_mx_weight(4096, 4096, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    bias32 = torch.randn(4096, device="cuda")
    for m in (2, 40, 300):
        x = random_act(m, 4096, dtype=torch.float16, device="cuda")
        y = mxgemm.linear(x, w, bias32.half())
        assert y.dtype == torch.float16 and torch.equal(
            y, linear_op(x, w.op_tensors, bias32.half(), w.backend, w.op_meta)
        )
        wide = random_act(m, 8192, device="cuda")[:, ::2]  # rows of stride 8192, elements of stride 2
        assert torch.equal(mxgemm.linear(wide, w), mxgemm.linear(wide.contiguous(), w))
        shifted = random_act(m * 4096 + 1, 1, device="cuda").view(-1)[1:].view(m, 4096)  # 2 bytes off alignment
        assert shifted.is_contiguous() and shifted.data_ptr() % 16
        assert torch.equal(mxgemm.linear(shifted, w), mxgemm.linear(shifted.clone(), w))


def test_leading_dimensions_run_as_rows():
    """3-D activations (as Hugging Face layers pass them) run the plan of their rows without reshapes: the same bits
    as the 2-D call on every path (small-M, FP8, cuBLASLt), contiguous or with gapped rows, with a bf16 or fp32
    bias, and one plan per number of rows."""
    q, s = random_mx_weight(4096, 4096, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    bias = torch.randn(4096, device="cuda")
    for m in (4, 24, 40, 300):
        x = random_act(m, 4096, seed=m, device="cuda")
        for b in (None, bias.bfloat16(), bias):
            flat = mxgemm.linear(x, w, b)
            assert torch.equal(mxgemm.linear(x.view(1, m, 4096), w, b), flat.view(1, m, 4096))
            assert torch.equal(mxgemm.linear(x.view(m, 1, 4096), w, b), flat.view(m, 1, 4096))
            gapped = torch.stack([x, x], dim=1)[:, :1]  # [m, 1, K], rows 2K apart
            assert not gapped.is_contiguous() and torch.equal(mxgemm.linear(gapped, w, b), flat.view(m, 1, 4096))
    assert sorted({key[0] for key in w.plans.launch}) == [4, 24, 40, 300]


@pytest.mark.parametrize("m", [4, 24])  # the small-M kernel's graph; the quantizer and the FP8 GEMM launched directly
def test_plans_follow_new_contents_and_new_addresses(m):
    """A plan's calls on one buffer whose contents change (a graphed plan leaves its nodes as they are when a call's
    launch equals the last one), on seven buffers taken in turn and back to the first, and with and without a bias,
    each match the twin of their regime."""
    q, s = random_mx_weight(4096, 4096, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    quantized = m >= w.info["crossover"]
    one = torch.empty(m, 4096, device="cuda", dtype=torch.bfloat16)
    others = [random_act(m, 4096, seed=9 + j, device="cuda") for j in range(6)]
    for i in range(3):
        one.copy_(random_act(m, 4096, seed=i, device="cuda"))  # same address, new contents
        for x in (one, *others, one, others[i]):
            for b in (None, bias, bias, None):
                y = mxgemm.linear(x, w, b)
                expected = exact_product(*hybrid_operands(x, q, s, quantized=quantized), b)
                assert_within_ulp(y, expected, sums=FP8_TENSOR_CORE_SUMS if quantized else FP32_SUMS)


@pytest.mark.parametrize("backend", ["hybrid_sm90", "cublas_block", "triton"])
def test_one_copy_of_the_weight_on_the_gpu(backend):
    """A layer built from checkpoint tensors holds at most 1.07 bytes per parameter once the checkpoint's own
    tensors are gone, and its state dict gives them back: they dequantize to what the layer computes."""
    n, k = 6144, 4096
    q, s = random_mx_weight(n, k, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    layer = mxgemm.MXFP8Linear.from_quantized(q.clone(), s.clone(), backend=backend)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert held <= 1.07 * n * k, (backend, held / (n * k))
    assert layer.prepared.nbytes <= 1.07 * n * k
    state = layer.state_dict()
    wq, ws = state["weight"], state["weight_scale"]
    assert wq.shape == (n, k) and ws.shape == (n, k // 32) and ws.dtype == torch.uint8
    mine = mxgemm.dequantize(mxgemm.MXTensor(wq.contiguous(), ws))
    if backend == "triton":
        assert torch.equal(mine, mxgemm.dequantize(mxgemm.MXTensor(q, s)))
    else:
        assert torch.equal(mine, reencode_block128(q, s).dequantize())
    x = random_act(5, k, device="cuda")
    fresh = mxgemm.MXFP8Linear.from_quantized(wq.contiguous(), ws, backend=backend)
    with torch.no_grad():
        assert torch.equal(fresh(x), layer(x))


def test_eager_path_under_graph_capture_and_compile():
    """Plans made eagerly replay correctly in a CUDA graph; the compiled op path agrees with them bit for bit."""
    lin = torch.nn.Linear(4096, 4096, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = mxgemm.MXFP8Linear.from_linear(lin)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        for m in (1, 16, 64):
            static_x = random_act(m, 4096, device="cuda")
            layer(static_x)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = layer(static_x)
            x = random_act(m, 4096, seed=m + 7, device="cuda")
            static_x.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_y, layer(x)) and torch.equal(compiled(x), layer(x))


# (weight N x K, M, what hybrid_sm90 launches eagerly there: substrings of the kernels' names, in order)
_EAGER_KERNELS = [
    ((4096, 4096), 1, ["small_m_kernel"]),
    ((4096, 4096), 16, ["small_m_kernel"]),
    # the quantizer, then the GEMM with its configuration (tile N, rows per warp group, stages, K chunks)
    ((4096, 4096), 24, ["quant_1x128", "fp8_gemm_kernel<32, 1, 6, 2>"]),
    ((6144, 4096), 24, ["quant_1x128", "fp8_gemm_kernel<32"]),
    ((4096, 4096), 64, ["quant_1x128", "fp8_gemm_tokm_kernel<64"]),
    ((4096, 4096), 300, ["quant_1x128", ""]),  # then cuBLASLt's blockwise kernel
    ((28672, 4096), 1, ["quant_1x128", "fp8_gemm_kernel<8"]),  # large weights: FP8 from M = 1
]


@pytest.mark.parametrize("shape,m,expected", _EAGER_KERNELS)
def test_each_regime_launches_the_kernels_it_names_and_writes_every_output(shape, m, expected, monkeypatch):
    """The crossover and launch rules, checked by the kernels the profiler sees; the output, allocated where a
    NaN-filled block of the same size was just freed, comes back fully written and matches the op."""
    monkeypatch.setenv("MXGEMM_AUTOTUNE", "0")
    n, k = shape
    q, s = random_mx_weight(n, k, device="cuda")
    layer = mxgemm.MXFP8Linear.from_quantized(q, s, backend="hybrid_sm90")
    x = random_act(m, k, device="cuda")
    with torch.inference_mode():
        layer(x)  # the plan is made, and the library loaded, outside the profile
        names = kernels_launched(lambda: layer(x))
        position = 0
        for want in expected:
            found = [i for i, name in enumerate(names) if want in name and i >= position]
            assert found, (want, names)
            position = found[0] + 1
        if m == 300:
            assert not any("fp8_gemm" in name for name in names), names
        poison = torch.full((max(m, 64) * 4, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        del poison
        y = layer(x)
        w = layer.prepared
        assert torch.isfinite(y).all()
        assert torch.equal(y, linear_op(x, w.op_tensors, None, w.backend, w.op_meta))


# (weight N x K): odd and real shapes; the crossover each gets on the H200 decides the M values tested
_CROSSOVER_SHAPES = [(130, 96), (4160, 4160), (6144, 4096), (4096, 14336), (28672, 4096)]


@pytest.mark.parametrize("shape", _CROSSOVER_SHAPES)
def test_the_prepared_crossover_splits_the_kernels_and_every_output_is_written(shape, monkeypatch):
    """Just below the crossover the prepared weight records, the exact kernels run (the small-M kernel up to
    M = 16, Triton above) and match the exact twin; at it, the quantizer and an FP8 GEMM run and match the quantized
    twin; element by element, each output landing on NaN-poisoned memory."""
    monkeypatch.setenv("MXGEMM_AUTOTUNE", "0")
    n, k = shape
    q, s = random_mx_weight(n, k, seed=n, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    crossover = w.info["crossover"]
    for m in (crossover - 1, crossover, crossover + 2):
        if m < 1:
            continue
        x = random_act(m, k, seed=m, device="cuda")
        mxgemm.linear(x, w)  # the plan is made, and the libraries loaded, outside the profile
        names = " ".join(kernels_launched(lambda: mxgemm.linear(x, w)))  # noqa: B023
        quantized = m >= crossover
        if not quantized:
            assert ("small_m_kernel" in names) == (m <= 16) and "fp8_gemm" not in names, (m, names)
        else:
            assert "fp8_gemm" in names and "small_m_kernel" not in names, (m, names)
        poison_cuda_allocator()
        y = mxgemm.linear(x, w)
        sums = FP8_TENSOR_CORE_SUMS if quantized else FP32_SUMS
        assert_within_ulp(
            y, exact_product(*hybrid_operands(x, q, s, quantized=quantized)), sums=sums, what=f"{shape} M={m}"
        )


def _fast_case(w, x, bias):
    """(the C++ table's answer, the Python launcher's) for a call of ``x`` whose plan the Python path made."""
    plan = w.plans.launch[(x.numel() // x.shape[-1], x.dtype, tuning.generation())]
    return (None if w.fast is None else w.fast(x, bias)), plan(x, bias), plan


@pytest.mark.parametrize("m", [1, 5, 16, 17, 48, 64, 100, 300])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1040, 4160)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fast_calls_give_the_python_launchers_bits(m, n, k, with_bias):
    """Once the Python path made M's plan, eager calls go through the weight's C++ table wherever the plan has an
    entry (the small-M kernel, our FP8 kernel; cuBLASLt's planned call of a bias-free weight of whole 128-row blocks)
    with the bits of the plan's Python launcher, for 2-D and 3-D activations and on another stream."""
    q, s = random_mx_weight(n, k, seed=m, device="cuda")
    w = mxgemm.prepare_weight(q, s, backend="hybrid_sm90")
    x = random_act(m, k, seed=m + 1, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if with_bias else None
    first = mxgemm.linear(x, w, bias)
    fast, python, plan = _fast_case(w, x, bias)
    entry = getattr(plan, "entry", None)
    assert (fast is not None) == (entry is not None and not (bias is not None and entry.kind == NO_BIAS))
    if n == 4096 and m <= 64:
        assert fast is not None, "Llama-sized weights run decode through C++"
    if fast is None:
        return
    assert torch.equal(fast, python) and torch.equal(fast, first)
    assert torch.equal(w.fast(x.view(1, m, k), bias), first.view(1, m, n))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = w.fast(x, bias)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, first)
    assert w.fast(x.half(), None) is None and w.fast(x.float(), None) is None


@pytest.mark.parametrize("m", [1, 16, 40, 64])
def test_fast_gated_calls_give_the_python_routes_bits(m):
    """Gated calls of a down projection go through the table once the Python path made M's route: its bits."""
    n, k = 4096, 14336  # Llama-3-8B's down projection: quantized activations from M = 1
    q, s = random_mx_weight(n, k, seed=m, device="cuda")
    layer = mxgemm.MXFP8Linear.from_quantized(q, s, backend="hybrid_sm90")
    gate, up = random_act(m, k, seed=1, device="cuda"), random_act(m, k, seed=2, device="cuda")
    first = layer.on_gated(gate, up)
    w = layer.prepared
    route = w.plans.gated.get((m, torch.bfloat16, tuning.generation()))
    if first is None or not hasattr(route, "entry"):
        pytest.skip(f"M = {m} does not run the FP8 kernel's gated route here (crossover {w.info['crossover']})")
    fast = w.fast.gated(gate, up, None)
    assert fast is not None and torch.equal(fast, first) and torch.equal(fast, route(gate, up, None))
    assert torch.equal(layer.on_gated(gate.view(1, m, k), up.view(1, m, k)), first.view(1, m, n))


def test_fast_calls_under_graph_capture():
    """A layer's eager call through the table, captured into a CUDA graph, replays on new contents."""
    q, s = random_mx_weight(4096, 4096, device="cuda")
    layer = mxgemm.MXFP8Linear.from_quantized(q, s, backend="hybrid_sm90")
    x = random_act(8, 4096, device="cuda")
    layer(x)
    assert layer.prepared.fast is not None and layer.prepared.fast(x, None) is not None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x)
    x.copy_(random_act(8, 4096, seed=5, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, layer(x))
