"""Hand-written kernels and thin bindings of library GEMMs: each module launches kernels and checks their launch
configs, nothing more (which kernel and config runs is a backend's choice). The Triton modules import Triton at
import time, so import them lazily.

The helpers here serve the bindings of the CUDA kernels (``small_m``, ``fp8_gemm``) and the tuning files."""

from __future__ import annotations

import ast
import ctypes
import functools
import hashlib
import re
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch


@functools.cache
def source_digest(root: Path = Path(__file__).parent) -> str:
    """A digest of the kernels' code (the Python and CUDA files of this package, or of ``root``): Python's syntax
    trees without docstrings, the CUDA sources without comments and with each run of blank space as one, so that an
    edit of comments, docstrings or layout alone keeps it and any other edit changes it. Tuning files record it:
    tactics timed on other kernels are not used."""
    digest = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("csrc/*")]):
        text = path.read_text()
        code = _python_code(text) if path.suffix == ".py" else _c_code(text)
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + code.encode())
    return digest.hexdigest()[:16]


def _python_code(text: str) -> str:
    tree = ast.parse(text)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return _tree_text(tree)


def _tree_text(node) -> str:
    """``ast.dump`` without the fields that are None or empty: the same text on every Python version, where
    ``ast.dump``'s differs by the fields a version adds empty (3.12's ``type_params`` of every function)."""
    if isinstance(node, list):
        return "[" + ", ".join(map(_tree_text, node)) + "]"
    if not isinstance(node, ast.AST):
        return repr(node)
    fields = (
        f"{name}={_tree_text(value)}" for name, value in ast.iter_fields(node) if value is not None and value != []
    )
    return f"{type(node).__name__}({', '.join(fields)})"


# string and character literals (kept whole), or a run of blank space and comments (one space)
_C_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|(?:\s|//[^\n]*|/\*.*?\*/)+', re.S)


def _c_code(text: str) -> str:
    return _C_TOKEN.sub(lambda m: m[0] if m[0][0] in "\"'" else " ", text).strip()


def raw_stream(device_index: int) -> int:
    """The current CUDA stream of a device as an integer handle (what Triton's launcher reads too)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def check_bf16_bias(bias: torch.Tensor | None, n: int) -> None:
    """The kernels add a bias in their epilogue only as a contiguous bf16 ``[n]`` tensor."""
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous bf16 [{n}] tensor, got {bias.dtype} {tuple(bias.shape)}")


def rows_in_place(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] or [..., K] as the CUDA launchers read its rows: itself where they are evenly strided with unit
    stride along K (a 2-D tensor) or it is contiguous, else a contiguous copy. Its row stride is then ``x.stride(0)``
    (2-D) or K."""
    if (x.stride(1) == 1) if x.dim() == 2 else x.is_contiguous():
        return x
    return x.contiguous()


def shaped_as(y: torch.Tensor, x: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """The launchers' output buffer ``y`` (its first ``m * n`` elements the result) shaped [m, n], or [..., n] after
    ``x``'s leading dimensions, by ``resize_``: its storage stays, and on a CPU host it costs less than a slice or a
    view."""
    return y.resize_(m, n) if x.dim() == 2 else y.resize_(*x.shape[:-1], n)


# How csrc/fast_call.cpp calls a LaunchEntry's function, each returning 0 or an error:
ROWS_BIAS = 0  # (plan, x, ldx, bias, y, stream): rows of x at stride ldx, a contiguous bf16 bias added in the epilogue
SMALL_M = 1  # (plan, x, bias, y, stream): x contiguous and 16-byte aligned, the bias as above
NO_BIAS = 2  # (plan, x, ldx, y, stream): no bias
GATED = 3  # (plan, gate, ldg, up, ldu, bias, y, stream): the product silu(gate) * up, the bias as above


class LaunchEntry(NamedTuple):
    """A launch plan as C++ calls it (:mod:`mxgemm.fastcall`), for bf16 activations: how (``kind``, one of the four
    above), the C function's and the plan's addresses, and the rows and columns of the bf16 buffer a call allocates
    and the function writes (its first M x n elements the output)."""

    kind: int
    fn: int
    plan: int
    rows: int
    cols: int


@dataclass(eq=False)
class Launch:
    """A kernel's launch plan of one shape, called as its Python launcher (``run``), with what else it offers:
    ``entry``, the plan as C++ calls it for bf16 activations (:mod:`mxgemm.fastcall`), or None; ``gated``, the plan of
    the call on the product ``silu(gate) * up`` a gated MLP feeds its down projection (a Launch called ``(gate, up,
    bias)``), or None; ``sharing`` and ``on_quantized``, cuBLASLt's call that also answers the rows it quantized and
    its GEMM alone on such rows, or None; ``keep``, what the launch needs alive as long as it lives (the C structures
    its addresses point into, the plan it wraps). What the plan made in C (CUDA graphs, cuBLASLt descriptors) is
    freed when the Launch is dropped (:func:`free_with`)."""

    run: Callable[..., torch.Tensor]
    entry: LaunchEntry | None = None
    gated: Launch | None = None
    sharing: Callable[..., tuple[torch.Tensor, Any]] | None = None
    on_quantized: Callable[..., torch.Tensor] | None = None
    keep: Any = None

    def __call__(self, *args: torch.Tensor | None) -> torch.Tensor:
        return self.run(*args)


def address(fn) -> int:
    """The address of a ctypes function."""
    return ctypes.cast(fn, ctypes.c_void_p).value


def free_with(launch: Launch, free: Callable, plans: Iterable[ctypes.Structure]) -> None:
    """When ``launch`` is dropped, ``free`` (a C function taking a plan's address) releases what each of ``plans``
    made (their CUDA graphs); the structures stay alive until then."""
    weakref.finalize(launch, _free_each, free, list(plans))


def _free_each(free: Callable, plans: list[ctypes.Structure]) -> None:
    for plan in plans:
        free(ctypes.addressof(plan))
