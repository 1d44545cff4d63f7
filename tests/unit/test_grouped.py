"""Grouped weights of a mixture of experts on CPU: prepared once, run on rows sorted by expert through one op, equal
to each expert's dense call (its emulated twin) whatever the routing; the op's fake, compile, the resolver's reasons
and one-line errors for bad input."""

import os

import pytest
import torch
from helpers import assert_within_ulp, exact_product, hybrid_operands, random_act, random_mx_weight, sqnr_db

import mxgemm
from mxgemm.backends import PreparedGroupedWeight
from mxgemm.ops import grouped_linear_op

E, N, K = 4, 130, 96
RECIPES = ["w8a16", "w8a8-mx", "w8a8-block"]
# each expert's rows, as counts: uneven, empty experts, all on one expert, one token, no tokens
ROUTINGS = {"uneven": [3, 0, 5, 1], "one expert": [0, 9, 0, 0], "one token": [0, 0, 0, 1], "none": [0, 0, 0, 0]}


interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1")


def _experts(e=E, n=N, k=K):
    pairs = [random_mx_weight(n, k, seed=i) for i in range(e)]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _offsets(counts) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_row_is_its_experts_dense_call(recipe, routing, dtype):
    """Row by row the same bits as the dense call of its expert's weight (the twin of the recipe), rows past the last
    expert's end zero, every row written."""
    q, s = _experts()
    w = mxgemm.prepare_grouped_weight(q, s, backend="emulation", recipe=recipe)
    counts = ROUTINGS[routing]
    extra = 2  # rows past offsets[-1]
    x = random_act(sum(counts) + extra, K, dtype=dtype)
    y = mxgemm.grouped_linear(x, w, _offsets(counts))
    assert y.shape == (x.shape[0], N) and y.dtype == dtype and torch.isfinite(y).all()
    start = 0
    for e, count in enumerate(counts):
        dense = mxgemm.prepare_weight(q[e], s[e], backend="emulation", recipe=recipe)
        rows = x[start : start + count]
        if count:
            assert torch.equal(y[start : start + count], mxgemm.linear(rows, dense)), f"expert {e}"
            reference = rows.float() @ mxgemm.dequantize(mxgemm.MXTensor(q[e], s[e])).T
            assert sqnr_db(y[start : start + count].float(), reference) >= 25
        start += count
    assert torch.equal(y[start:], torch.zeros_like(y[start:]))


def test_the_prepared_copy_is_one_byte_a_parameter_and_exports_what_it_computes():
    q, s = _experts(n=256, k=256)
    for recipe in RECIPES:
        w = mxgemm.prepare_grouped_weight(q, s, backend="emulation", recipe=recipe)
        assert isinstance(w, PreparedGroupedWeight) and w.experts == E and (w.out_features, w.in_features) == (256, 256)
        assert 1.0 <= w.nbytes / q.numel() <= 1.07, recipe
        eq, es = mxgemm.backends.get_backend("emulation").export_grouped_mx(w)
        assert eq.shape == q.shape and es.shape == s.shape
        x = random_act(6, 256)
        again = mxgemm.prepare_grouped_weight(eq, es, backend="emulation", recipe=recipe)
        offsets = _offsets([1, 2, 0, 3])
        assert torch.equal(mxgemm.grouped_linear(x, again, offsets), mxgemm.grouped_linear(x, w, offsets))


def test_a_prepared_weight_prints_what_it_holds_not_its_values():
    q, s = _experts(n=64, k=128)
    w = mxgemm.prepare_grouped_weight(q, s, backend="emulation", recipe="w8a16")
    assert repr(w) == (
        f"PreparedGroupedWeight(backend='emulation', recipe='w8a16', out_features=64, in_features=128, experts={E}, "
        f"qdata=float8_e4m3fn[{E}, 64, 128], scale=uint8[{E}, 64, 4], {E * 64 * 132} bytes on cpu)"
    )
    dense = mxgemm.prepare_weight(q[0], s[0], backend="emulation", recipe="w8a16")
    assert repr(dense).startswith("PreparedWeight(backend='emulation', recipe='w8a16', out_features=64, in_features=")


@interpreter
def test_auto_takes_a_backend_that_runs_grouped_weights_and_a_named_one_that_does_not_says_so(monkeypatch):
    q, s = _experts()
    assert mxgemm.prepare_grouped_weight(q, s).backend == "triton"  # the Triton interpreter (tests set it)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert mxgemm.prepare_grouped_weight(q, s).backend == "emulation"  # a plain CPU
    with pytest.raises(mxgemm.BackendUnavailableError, match=r"cublas_block.*runs dense weights only"):
        mxgemm.prepare_grouped_weight(q, s, backend="cublas_block")
    with pytest.raises(mxgemm.BackendUnavailableError, match=r"cublas_mx.*needs a CUDA GPU"):
        mxgemm.prepare_grouped_weight(q, s, backend="cublas_mx")
    with pytest.raises(mxgemm.BackendUnavailableError, match="computes grouped weights in w8a16/w8a8-mx/w8a8-block"):
        mxgemm.prepare_grouped_weight(q, s, backend="emulation", recipe="hybrid-block128")
    with pytest.raises(mxgemm.BackendUnavailableError, match=r"computes grouped weights in w8a8-block, not .* w8a16"):
        mxgemm.prepare_grouped_weight(q, s, backend="triton", recipe="w8a16")


def _check_against_twin(y, x, q, s, counts, what=""):
    """Each expert's rows within the FP8 GEMM's rounding of the twin's exact product (activations 1x128-quantized,
    the weight re-encoded to 128x128 blocks), the rows past the last expert's end zero."""
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = x[start : start + count]
            product = exact_product(*hybrid_operands(rows, q[e], s[e], quantized=True))
            assert_within_ulp(y[start : start + count], product, what=f"{what} expert {e}")
        start += count
    assert torch.equal(y[start:], torch.zeros_like(y[start:])), what


@interpreter
@pytest.mark.parametrize("routing", [*ROUTINGS, "tokens past the tile"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_triton_kernel_is_its_twin_for_every_routing_and_config(routing, dtype):
    """The grouped FP8 kernel under the interpreter, on N and K that are not multiples of its tiles (K = 160: a
    128-deep step and a 32-deep one), every config shape: each row within the fp32 sums' rounding of the twin."""
    from mxgemm.kernels.grouped.fp8 import GroupedConfig, grouped_block_linear
    from mxgemm.kernels.grouped.gemv import GemvConfig

    n, k = 130, 160
    q, s = _experts(n=n, k=k)
    w = mxgemm.prepare_grouped_weight(q, s, backend="triton")
    assert w.recipe == "w8a8-block" and w.experts == E
    counts = ROUTINGS.get(routing, [17, 0, 1, 20])
    x = random_act(sum(counts) + 2, k, dtype=dtype, seed=len(routing))
    offsets = _offsets(counts)
    _check_against_twin(mxgemm.grouped_linear(x, w, offsets), x, q, s, counts, "default")
    qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
    configs = (GroupedConfig(16, 16), GroupedConfig(256, 32, 8), GroupedConfig(32, 16, quantized=True))
    gemvs = (GemvConfig(16, 1, 2), GemvConfig(64, 2, 4, 3), GemvConfig(16, 16))  # K = 160: 2 steps, 1 of 256, 1 of 2048
    for config in (*configs, *gemvs):
        _check_against_twin(grouped_block_linear(x, qd, bs, offsets, n, config), x, q, s, counts, str(config))


@interpreter
def test_the_triton_backend_refuses_grouped_weights_it_would_change_or_cannot_run(monkeypatch):
    q, s = _experts()
    with pytest.raises(mxgemm.BackendUnavailableError, match="re-encodes E4M3 weights only"):
        mxgemm.prepare_grouped_weight(q.to(torch.float8_e5m2), s, backend="triton")
    s_far = s.clone()
    s_far[1, :, 0] += 6  # one 32-block above the others of its 128x128 block: their smallest elements would round
    monkeypatch.setenv("MXGEMM_REENCODE_MAX_ERROR", "0")
    with pytest.raises(mxgemm.BackendUnavailableError, match="MXGEMM_REENCODE_MAX_ERROR"):
        mxgemm.prepare_grouped_weight(q, s_far, backend="triton")
    assert mxgemm.prepare_grouped_weight(q, s_far).backend == "emulation"  # auto moves on, in w8a16
    from mxgemm.backends import get_backend
    from mxgemm.device import DeviceInfo
    from mxgemm.resolve import explain_auto

    ampere = DeviceInfo("cuda", "A100", (8, 0), 0)
    answer = explain_auto(ampere, grouped=True)
    assert answer.backend.name == "emulation"
    assert ("triton", f"grouped weights need FP8 tensor cores (compute capability >= 8.9); {ampere} is below that") in (
        answer.skipped
    )
    assert get_backend("triton").check_grouped(DeviceInfo("cuda", "H200", (9, 0), 0))


def test_the_op_has_exact_fake_shapes_and_crosses_the_boundary():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, s = _experts()
    w = mxgemm.prepare_grouped_weight(q, s, backend="emulation", recipe="w8a8-block")
    x, offsets = random_act(7, K), _offsets([2, 2, 0, 3])
    real = grouped_linear_op(x, offsets, w.op_tensors, w.backend, w.op_meta)
    with FakeTensorMode() as mode:
        fake = grouped_linear_op(
            mode.from_tensor(x),
            mode.from_tensor(offsets),
            [mode.from_tensor(t) for t in w.op_tensors],
            w.backend,
            w.op_meta,
        )
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    copies = [t.clone() for t in w.op_tensors]  # not the live weight's: rebuilt from the meta, experts included
    assert torch.equal(grouped_linear_op(x, offsets, copies, w.backend, w.op_meta), real)
    torch.library.opcheck(grouped_linear_op, (x, offsets, w.op_tensors, w.backend, w.op_meta))


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager_for_any_routing(compile_backend):
    """One graph serves every routing of a token count: the offsets are data, not shapes."""
    q, s = _experts()
    w = mxgemm.prepare_grouped_weight(q, s, backend="emulation", recipe="w8a8-mx")

    def experts(x, offsets):
        return torch.relu(mxgemm.grouped_linear(x, w, offsets)) * 2

    compiled = torch.compile(experts, fullgraph=True, backend=compile_backend)
    x = random_act(9, K)
    for counts in ([3, 0, 5, 1], [0, 9, 0, 0], [9, 0, 0, 0]):
        assert torch.equal(compiled(x, _offsets(counts)), experts(x, _offsets(counts)))


@pytest.mark.parametrize(
    "case, error, message",
    [
        ("2-D weight", ValueError, r"grouped weights must be 3-D \[E, N, K\]"),
        ("fp32 x", TypeError, "activations must be bfloat16 or float16"),
        ("x of other K", ValueError, r"x must be \[S, 96\]"),
        ("int64 offsets", ValueError, r"offsets must be int32 \[4\]"),
        ("offsets of other E", ValueError, r"offsets must be int32 \[4\]"),
        ("a dense weight", TypeError, "weight must be a PreparedGroupedWeight .* got PreparedWeight; a dense weight"),
        ("linear of a grouped weight", TypeError, "got PreparedGroupedWeight; an experts' grouped weight runs through"),
        ("linear of an MXTensor", TypeError, r"got MXTensor; prepare it once with mxgemm\.prepare_weight"),
    ],
)
def test_bad_input_is_a_one_line_error(case, error, message):
    q, s = _experts()
    w = mxgemm.prepare_grouped_weight(q, s, backend="emulation")
    x, offsets = random_act(5, K), _offsets([1, 1, 1, 2])
    with pytest.raises(error, match=message):
        if case == "2-D weight":
            mxgemm.prepare_grouped_weight(q[0], s[0])
        elif case == "fp32 x":
            mxgemm.grouped_linear(x.float(), w, offsets)
        elif case == "x of other K":
            mxgemm.grouped_linear(random_act(5, 64), w, offsets)
        elif case == "int64 offsets":
            mxgemm.grouped_linear(x, w, offsets.long())
        elif case == "offsets of other E":
            mxgemm.grouped_linear(x, w, offsets[:3])
        elif case == "a dense weight":
            mxgemm.grouped_linear(x, mxgemm.prepare_weight(q[0], s[0], backend="emulation"), offsets)
        elif case == "linear of a grouped weight":  # its K matches: the call would have run as a dense one
            mxgemm.linear(x, w)
        else:
            mxgemm.linear(x, mxgemm.MXTensor(q[0], s[0]))
