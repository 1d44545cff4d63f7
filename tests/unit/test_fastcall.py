"""The C++ table of eager calls (mxgemm.fastcall, csrc/fast_call.cpp), built here and run on CPU tensors with C
functions made by ctypes in the kernels' place: what each kind of entry is called with, the output it answers, and
every case where it leaves the call to the Python path (None)."""

import ctypes
import gc
import tempfile
import weakref

import pytest
import torch
from helpers import random_act, random_mx_weight
from torch.utils._python_dispatch import TorchDispatchMode

import mxgemm
from mxgemm import fastcall, tuning
from mxgemm.kernels import GATED, NO_BIAS, ROWS_BIAS, SMALL_M, Launch, LaunchEntry

K, N = 64, 64  # the stand-in kernels copy rows of x into rows of y: n = k
P, INT = ctypes.c_void_p, ctypes.c_int
SIGNATURES = {
    ROWS_BIAS: ctypes.CFUNCTYPE(INT, P, P, INT, P, P, P),
    SMALL_M: ctypes.CFUNCTYPE(INT, P, P, P, P, P),
    NO_BIAS: ctypes.CFUNCTYPE(INT, P, P, INT, P, P),
    GATED: ctypes.CFUNCTYPE(INT, P, P, INT, P, INT, P, P, P),
}


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # built before the per-test cache folder is set: not in the user's
        patch.setenv("MXGEMM_CACHE_DIR", str(tmp_path_factory.mktemp("mxgemm-ext")))
        answer = fastcall.status()
    assert answer, answer.reason  # CI installs what it builds with: a build that fails here is a defect
    return fastcall.extension()


def _rows(address: int, stride: int, m: int) -> torch.Tensor:
    """The [m, K] bf16 rows at ``address``, ``stride`` elements apart, copied out."""
    raw = (ctypes.c_uint16 * ((m - 1) * stride + K)).from_address(address)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.int16)
    return flat.as_strided((m, K), (stride, 1)).clone().view(torch.bfloat16)


class StandIn:
    """A C function of one kind that records its arguments and writes x's rows (gated: gate's rows + up's) into y's
    first M rows, plus the bias where one is passed; returns ``err``."""

    def __init__(self, kind: int, m: int, err: int = 0):
        self.kind, self.m, self.err, self.calls = kind, m, err, []
        self.fn = SIGNATURES[kind](self._run)
        self.plan = ctypes.c_int(0)
        self.address = ctypes.addressof(self.plan)

    def entry(self, rows: int | None = None) -> LaunchEntry:
        return LaunchEntry(self.kind, ctypes.cast(self.fn, P).value, self.address, rows or self.m + 3, N)

    def _run(self, *args) -> int:
        if self.kind == ROWS_BIAS:
            plan, x, ldx, bias, y, stream = args
            out = _rows(x, ldx, self.m)
        elif self.kind == SMALL_M:
            plan, x, bias, y, stream = args
            ldx, out = K, _rows(x, K, self.m)
        elif self.kind == NO_BIAS:
            plan, x, ldx, y, stream = args
            bias, out = None, _rows(x, ldx, self.m)
        else:
            plan, g, ldg, u, ldu, bias, y, stream = args
            ldx, out = ldg, _rows(g, ldg, self.m) + _rows(u, ldu, self.m)
        if bias:
            out = out + _rows(bias, 0, self.m)
        self.calls.append({"plan": plan, "ldx": ldx, "bias": bias, "stream": stream})
        ctypes.memmove(y, out.contiguous().data_ptr(), out.numel() * 2)
        return self.err


def _table(ext, kind: int, m: int, err: int = 0):
    stand_in = StandIn(kind, m, err)
    table = ext.Table(torch.device("cpu"), K, N)
    ext.set_generation(tuning.generation())
    table.add(m, *stand_in.entry(), tuning.generation(), stand_in)
    return table, stand_in


@pytest.mark.parametrize("shape", [(5, K), (1, 5, K), (5, 1, K)])
def test_rows_bias_entry(ext, shape):
    table, fn = _table(ext, ROWS_BIAS, 5)
    x = random_act(5, K).reshape(shape)
    bias = random_act(1, N)[0]
    y = table(x, bias)
    assert y.shape == (*shape[:-1], N) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert torch.equal(y, x + bias)
    call = fn.calls[-1]
    assert call == {"plan": fn.address, "ldx": K, "bias": bias.data_ptr(), "stream": None}
    assert torch.equal(table(x, None), x) and fn.calls[-1]["bias"] is None
    with torch.inference_mode():  # the output an inference tensor, shaped the same
        y = table(x.clone(), bias)
    assert y.is_inference() and y.shape == (*shape[:-1], N) and torch.equal(y, x + bias)


def test_rows_read_in_place_at_their_stride(ext):
    """2-D rows evenly strided with unit stride along K: read in place; strided leading dimensions: None (the Python
    launcher copies them)."""
    table, fn = _table(ext, ROWS_BIAS, 4)
    wide = random_act(4, 3 * K)
    y = table(wide[:, K : 2 * K], None)
    assert torch.equal(y, wide[:, K : 2 * K]) and fn.calls[-1]["ldx"] == 3 * K
    assert table(wide.reshape(2, 2, 3 * K)[..., :K], None) is None
    assert table(random_act(K, 4).t(), None) is None  # unit stride along M


def test_small_m_entry_needs_contiguous_aligned_rows(ext):
    table, _ = _table(ext, SMALL_M, 3)
    x = random_act(3, K)
    assert torch.equal(table(x, None), x)
    wide = random_act(3, K + 8)
    assert table(wide[:, :K], None) is None  # evenly strided, not contiguous
    flat = random_act(1, 3 * K + 1)[0]
    assert table(flat[1:].view(3, K), None) is None  # 2 bytes past 16-byte alignment


def test_no_bias_entry_takes_no_bias(ext):
    table, _ = _table(ext, NO_BIAS, 2)
    x = random_act(2, K)
    assert torch.equal(table(x, None), x)
    assert table(x, random_act(1, N)[0]) is None


def test_gated_entry(ext):
    table, fn = _table(ext, GATED, 3)
    gate, up = random_act(3, K, seed=1), random_act(3, K, seed=2)
    wide = random_act(3, 2 * K)
    y = table.gated(gate, wide[:, K:], None)
    assert torch.equal(y, gate + wide[:, K:]) and fn.calls[-1]["ldx"] == K
    assert table.gated(gate.reshape(1, 3, K), up.reshape(1, 3, K), None).shape == (1, 3, N)
    assert table(gate, None) is None  # a gated entry serves gated calls only
    assert table.gated(gate, up[:2], None) is None
    assert table.gated(gate, up.half(), None) is None


@pytest.mark.parametrize(
    "case",
    [
        "other M",
        "fp16",
        "fp32",
        "other K",
        "subclass",
        "parameter",
        "grad",
        "empty",
        "bias fp32",
        "bias shape",
        "bias strided",
        "bias grad",
        "failed launch",
        "dispatch mode",
    ],
)
def test_python_path_cases(ext, case):
    """Each case the plan's Python launcher takes differently (or the Python path refuses) answers None; the same
    call with the case undone answers."""
    table, _ = _table(ext, ROWS_BIAS, 4, err=7 if case == "failed launch" else 0)
    x, bias = random_act(4, K), random_act(1, N)[0]

    class Sub(torch.Tensor):
        pass

    if case == "other M":
        x = random_act(3, K)
    elif case in ("fp16", "fp32"):
        x = x.to(torch.float16 if case == "fp16" else torch.float32)
    elif case == "other K":
        x = random_act(2, 2 * K)
    elif case == "subclass":
        x = x.as_subclass(Sub)
    elif case == "parameter":
        bias = torch.nn.Parameter(bias, requires_grad=False)
    elif case == "grad":
        x.requires_grad_(True)
    elif case == "empty":
        x = x[:0]
    elif case == "bias fp32":
        bias = bias.float()
    elif case == "bias shape":
        bias = random_act(1, N + 1)[0]
    elif case == "bias strided":
        bias = random_act(1, 2 * N)[0, ::2]
    elif case == "bias grad":
        bias.requires_grad_(True)
    if case == "dispatch mode":
        with TorchDispatchMode():
            assert table(x, bias) is None
    else:
        assert table(x, bias) is None
    if case in ("grad", "bias grad"):
        with torch.no_grad():
            assert table(x, bias) is not None


def test_stale_generation_and_clear(ext):
    table, fn = _table(ext, ROWS_BIAS, 2)
    x = random_act(2, K)
    assert table(x, None) is not None
    tuning.changed()  # what a tuner does when it writes a cache: the extension hears of it
    assert table(x, None) is None
    table.add(2, *fn.entry(), tuning.generation(), fn)  # the Python path's plan of the new generation
    assert table(x, None) is not None
    keep = weakref.ref(fn)
    del fn
    assert keep() is not None and len(table) == 1  # the table keeps the launcher alive
    table.clear()
    gc.collect()  # the stand-in's C function refers back to it
    assert keep() is None and len(table) == 0 and table(x, None) is None


def test_unknown_kind_is_refused(ext):
    table = ext.Table(torch.device("cpu"), K, N)
    with pytest.raises(RuntimeError, match="unknown entry kind"):
        table.add(1, 9, 0, 0, 1, N, 0, None)


def test_linear_calls_the_table_first(ext, monkeypatch):
    """A plan with an entry, made by the Python path, joins the weight's table; the next call of that M goes through
    it (here the stand-in's answer, not the emulation's), other M and fp16 take the Python path."""
    q, s = random_mx_weight(N, K)
    w = mxgemm.prepare_weight(q, s, backend="emulation")
    stand_in = StandIn(ROWS_BIAS, 4)
    python_path = mxgemm.ops._plan

    def plan(x, weight, m):
        made = python_path(x, weight, m)
        if m == 4:
            made = Launch(made, entry=stand_in.entry())
        return made

    monkeypatch.setattr(mxgemm.ops, "_plan", plan)
    x = random_act(4, K)
    first = mxgemm.linear(x, w)
    assert w.fast is not None and len(w.fast) == 1 and not stand_in.calls
    assert torch.equal(mxgemm.linear(x, w), x) and len(stand_in.calls) == 1
    mxgemm.linear(random_act(3, K), w)
    mxgemm.linear(x.half(), w)
    assert len(stand_in.calls) == 1 and not torch.equal(first, x)


def test_turned_off(ext, monkeypatch):
    monkeypatch.setenv("MXGEMM_FAST_CALLS", "0")
    fastcall.status.cache_clear()
    try:
        assert not fastcall.status() and "MXGEMM_FAST_CALLS" in fastcall.status().reason
        q, s = random_mx_weight(N, K)
        w = mxgemm.prepare_weight(q, s, backend="emulation")
        plan = Launch(lambda x, bias: x, entry=StandIn(ROWS_BIAS, 4).entry())
        fastcall.register(w, 4, torch.bfloat16, plan)
        assert w.fast is None
    finally:
        fastcall.status.cache_clear()


def test_the_table_empties_with_the_plans_and_is_not_copied(ext, monkeypatch):
    """Past MAX_PLANS the weight's plans start over, and its table with them (it holds their launchers); a copy of the
    weight makes its own plans and table."""
    import copy

    from mxgemm.backends import base

    q, s = random_mx_weight(N, K)
    w = mxgemm.prepare_weight(q, s, backend="emulation")
    plan = Launch(lambda x, bias: x, entry=StandIn(ROWS_BIAS, 4).entry())
    w.cached("launch", (4, torch.bfloat16, tuning.generation()), lambda: plan)
    fastcall.register(w, 4, torch.bfloat16, plan)
    assert len(w.fast) == 1
    assert copy.deepcopy(w).fast is None
    monkeypatch.setattr(base, "MAX_PLANS", 2)
    mxgemm.linear(random_act(1, K), w)
    mxgemm.linear(random_act(2, K), w)
    assert len(w.fast) == 0 and w.fast(random_act(4, K), None) is None


def test_why_the_extension_does_not_build(monkeypatch, tmp_path):
    """Each way the build can fail says what to do: no ninja, no folder it may write, a compiler error; the eager
    calls then take the Python path and `mxgemm info` says why."""
    from torch.utils import cpp_extension

    build = fastcall.extension.__wrapped__  # the uncached build: the module's own stays as it is
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install ninja"):
        build()
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(blocked))  # a file where the folder would be
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(blocked))
    with pytest.raises(RuntimeError, match=r"no folder to build fast_call.cpp in: .*file"):
        build()
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path / "cache"))

    def compiler_error(*args, **kwargs):
        raise RuntimeError("Error building extension 'mxgemm_fast_call': g++ not found")

    monkeypatch.setattr(cpp_extension, "load", compiler_error)
    with pytest.raises(RuntimeError, match=r"building fast_call.cpp failed: .*g\+\+ not found"):
        build()
    monkeypatch.setattr(fastcall, "extension", build)
    answer = fastcall.status.__wrapped__()
    assert not answer and answer.reason.startswith("the Python path: the C++ calls are not built (building")
