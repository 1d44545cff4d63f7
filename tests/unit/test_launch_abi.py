"""The C launch ABI has one definition, the C sources: every ctypes binding of an ``extern "C"`` function (its argument
and result types, and the library's list of symbols), every ctypes structure that mirrors a C struct (field names,
types and order) and the C++ table's call kinds (``mxgemm.kernels``' constants against ``fast_call.cpp``'s ``enum
Kind`` and its function types) are read from the sources and compared, nothing built."""

import ctypes
import re
import types
from pathlib import Path

import pytest

import mxgemm.kernels as kernels
from mxgemm.kernels import cublaslt, fp8_gemm, nvcc, small_m
from mxgemm.kernels.grouped import wgmma

SRC = Path(kernels.__file__).resolve().parents[1]
CSRC = SRC / "kernels" / "csrc"
LIBRARIES = {  # the binding's module, how it loads its library, and the library's source
    "fp8_gemm": (lambda: fp8_gemm.library.__wrapped__((9, 0)), CSRC / "fp8_gemm.cu"),
    "small_m": (lambda: small_m.library.__wrapped__((9, 0)), CSRC / "small_m.cu"),
    "cublaslt": (lambda: cublaslt._library.__wrapped__(), CSRC / "blockwise.cu"),
    "grouped wgmma": (
        lambda: wgmma.library.__wrapped__((9, 0)),
        SRC / "kernels" / "grouped" / "csrc" / "grouped_fp8.cu",
    ),
}
_C_SCALARS = {"int": "i32", "long long": "i64", "float": "f32", "void": None}
_CTYPES = {ctypes.c_void_p: "ptr", ctypes.c_int: "i32", ctypes.c_longlong: "i64", ctypes.c_float: "f32", None: None}


def _code(path: Path) -> str:
    """The source without its comments."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)


def _c_type(decl: str) -> str | None:
    """A C declaration's type class ('ptr', 'ptr*' for a pointer to a pointer, 'i32', 'i64', 'f32'; None for void),
    its name (if any) dropped."""
    stars = decl.count("*")
    words = [w for w in re.sub(r"[*&]", " ", decl).split() if w not in ("const", "struct", "__restrict__")]
    if stars:
        return "ptr" + "*" * (stars - 1)
    base = " ".join(words[:-1]) if len(words) > 1 and " ".join(words[:-1]) in _C_SCALARS else " ".join(words)
    return _C_SCALARS[base]


def _ctype(t) -> str | None:
    if t in _CTYPES:
        return _CTYPES[t]
    if isinstance(t, type) and issubclass(t, ctypes._Pointer):
        return _ctype(t._type_) + "*" if _ctype(t._type_) == "ptr" else "ptr"
    raise AssertionError(f"no C counterpart known for {t}")


def c_functions(path: Path) -> dict[str, tuple[str | None, list[str | None]]]:
    """Each ``extern "C"`` function of a source: (result type class, parameter type classes)."""
    found = {}
    for ret, name, params in re.findall(r'extern "C"\s+([\w\s*]+?)\s*\b(mxgemm_\w+)\s*\(([^)]*)\)', _code(path)):
        found[name] = (_c_type(ret), [_c_type(p) for p in params.split(",") if p.strip()])
    return found


class _Recorder:
    """What ``nvcc.build`` returns here: a library whose functions keep the argtypes and restype set on them."""

    def __init__(self, symbols):
        self.symbols = tuple(symbols)
        self.functions = {}

    def __getattr__(self, name):
        return self.functions.setdefault(name, types.SimpleNamespace(argtypes=None, restype=ctypes.c_int))


@pytest.mark.parametrize("library", list(LIBRARIES))
def test_every_ctypes_binding_is_its_c_declaration(library, monkeypatch, tmp_path):
    load, source = LIBRARIES[library]
    made = []
    monkeypatch.setattr(nvcc, "build", lambda *a, symbols=(), **k: made.append(_Recorder(symbols)) or made[-1])
    monkeypatch.setattr(cublaslt, "header_dir", lambda: tmp_path)
    load()
    (lib,) = made
    declared = c_functions(source)
    assert set(lib.symbols) == set(declared), f'{library}: the symbols loaded are not the source\'s extern "C" ones'
    assert set(lib.functions) == set(declared), f"{library}: not every function is bound"
    for name, fn in lib.functions.items():
        bound = (_ctype(fn.restype), [_ctype(t) for t in fn.argtypes])
        assert bound == declared[name], f"{library}: {name} is bound as {bound}, declared {declared[name]}"


def c_struct(path: Path, name: str) -> list[tuple[str, str]]:
    """A C struct's fields in order: (name, type class)."""
    body = re.search(rf"struct {name}\s*\{{(.*?)\}};", _code(path), re.S).group(1)
    fields = []
    for statement in filter(str.strip, body.split(";")):
        first, *more = (part.strip() for part in statement.split(","))
        kind = _c_type(first)
        fields.append((re.findall(r"\w+", first)[-1], kind))
        fields += [(other, kind) for other in more]
    return fields


@pytest.mark.parametrize(
    "structure, source, name, size",
    [
        (fp8_gemm._LinearPlan, CSRC / "fp8_gemm.cu", "LinearPlan", 104),
        (small_m._Plan, CSRC / "small_m.cu", "SmallMPlan", 72),
    ],
)
def test_every_ctypes_structure_is_the_c_struct_it_mirrors(structure, source, name, size):
    """Its fields (names, types, order), and its size the one the CUDA source asserts for the struct."""
    mirrored = [(field, _ctype(t)) for field, t in structure._fields_]
    assert mirrored == c_struct(source, name)
    asserted = re.search(rf"static_assert\(sizeof\({name}\) == (\d+)", source.read_text()).group(1)
    assert ctypes.sizeof(structure) == int(asserted) == size


def test_the_cpp_tables_call_kinds_are_the_python_constants_and_the_functions_registered_as_them():
    code = _code(SRC / "csrc" / "fast_call.cpp")
    enum = dict(re.findall(r"k(\w+)\s*=\s*(\d+)", re.search(r"enum Kind : int \{(.*?)\};", code, re.S).group(1)))
    python = {"RowsBias": kernels.ROWS_BIAS, "SmallM": kernels.SMALL_M, "NoBias": kernels.NO_BIAS}
    python["Gated"] = kernels.GATED
    assert {k: int(v) for k, v in enum.items()} == python
    # the C functions entries of each kind point to (fp8_gemm, small_m and cublaslt's LaunchEntry)
    registered = {
        "RowsBias": (CSRC / "fp8_gemm.cu", "mxgemm_fp8_linear_run"),
        "SmallM": (CSRC / "small_m.cu", "mxgemm_small_m_run"),
        "NoBias": (CSRC / "blockwise.cu", "mxgemm_blockwise_run"),
        "Gated": (CSRC / "fp8_gemm.cu", "mxgemm_fp8_linear_gated_run"),
    }
    for kind, (source, fn) in registered.items():
        params = re.search(rf"using {kind} = int \(\*\)\(([^)]*)\);", code).group(1)
        assert c_functions(source)[fn] == ("i32", [_c_type(p) for p in params.split(",")]), kind
