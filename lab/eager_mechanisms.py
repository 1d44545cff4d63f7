"""Host time of one eager linear-layer call by the mechanism that carries it from the module to the launch, the
kernel itself replaced by a C function that returns at once (so it runs on any host, GPU or not):

- ``python``: today's path: ``MXFP8Linear.forward`` -> ``weights.linear`` -> ``ops.run_planned`` -> a launcher shaped
  like the small-M kernel's (``torch.empty``, one ctypes call with the plan's address and the call's pointers);
- ``lean python``: the checks that C++ function makes, in one Python ``forward``, then the plan;
- ``pybind``: ``forward`` calls one C++ function (a pybind11 extension) that checks the input, finds the plan for M,
  allocates the output with ``at::empty`` and calls the C function;
- ``pybind wrapped``: that function bound through ``torch::wrap_pybind_function`` (torch's error handling), as
  ``torch.utils.cpp_extension.load_inline`` binds functions by default;
- ``torch.ops``: the same C++ body registered as an op (``TORCH_LIBRARY``) and called through ``torch.ops``;
  ``op._op``: the C++ function that op's Python wrapper (``OpOverload.__call__``) calls, called directly;
- ``floor``: a module whose ``forward`` returns its input; ``empty``: ``torch.empty`` of the output alone.

Each case is timed over 1000 calls per round, the cases interleaved round after round; the least round's time per call
(what the host's noise adds nothing to) and the median, [1, 1, K] activations.

Run: python3 lab/eager_mechanisms.py [--device cuda] (builds the C function and two small extensions with g++,
torch's and Python's headers: about a minute).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

import mxgemm
import mxgemm.ops as ops
from mxgemm import tuning

_NOOP_C = "int noop_run(void* plan, const void* x, const void* bias, void* y, void* stream) { return 0; }\n"

_BODY = r"""
#include <torch/extension.h>
#include <unordered_map>

using Run = int (*)(void*, const void*, const void*, void*, void*);
struct Plans { Run run; std::unordered_map<int64_t, void*> by_m; int64_t k, n; };
static std::unordered_map<int64_t, Plans> g_weights;

void add_plan(int64_t weight, int64_t run, int64_t m, int64_t plan, int64_t k, int64_t n) {
  auto& w = g_weights[weight];
  w.run = reinterpret_cast<Run>(run); w.by_m[m] = reinterpret_cast<void*>(plan); w.k = k; w.n = n;
}

torch::Tensor call(const torch::Tensor& x, const c10::optional<torch::Tensor>& bias, int64_t weight) {
  auto it = g_weights.find(weight);
  TORCH_CHECK(it != g_weights.end(), "no such weight");
  const Plans& w = it->second;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "activations must be bf16 or fp16");
  TORCH_CHECK(x.dim() > 0 && x.size(-1) == w.k, "input's last dimension must be in_features");
  TORCH_CHECK(x.is_contiguous(), "contiguous rows");
  const int64_t m = x.numel() / w.k;
  auto p = w.by_m.find(m);
  TORCH_CHECK(p != w.by_m.end(), "no plan for M");
  auto y = at::empty({m, w.n}, x.options());
  const int err = w.run(p->second, x.data_ptr(), bias ? bias->data_ptr() : nullptr, y.data_ptr(), nullptr);
  TORCH_CHECK(err == 0, "launch failed");
  if (x.dim() == 2) return y;
  auto shape = x.sizes().vec();
  shape.back() = w.n;
  return y.view(shape);
}
"""

_REGISTRATION = r"""
TORCH_LIBRARY(mx_mech, m) {
  m.def("call(Tensor x, Tensor? bias, int weight) -> Tensor", &call);
  m.def("add_plan(int weight, int run, int m, int plan, int k, int n) -> ()", &add_plan);
}
"""


_PYBIND = r"""
PYBIND11_MODULE(mx_mech_pybind, m) {
  m.def("add_plan", &add_plan);
  m.def("call", &call);
  m.def("call_wrapped", torch::wrap_pybind_function(call));  // as load_inline binds functions by default
}
"""


def build(folder: Path):
    """(the no-op C library, the pybind11 extension, the torch.ops namespace), compiled by g++ with torch's and
    Python's headers (no ninja)."""
    noop = ctypes.CDLL(str(_compile(folder, "libnoop.so", _NOOP_C, "c", [])))
    p = ctypes.c_void_p
    noop.noop_run.argtypes, noop.noop_run.restype = [p, p, p, p, p], ctypes.c_int
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    flags = ["-std=c++20", abi, *(f"-I{d}" for d in cpp_extension.include_paths()),
             f"-I{sysconfig.get_paths()['include']}", *(f"-L{d}" for d in cpp_extension.library_paths()),
             "-lc10", "-ltorch", "-ltorch_cpu"]  # fmt: skip
    python_module = _compile(folder, "mx_mech_pybind.so", _BODY + _PYBIND, "c++", [*flags, "-ltorch_python"])
    spec = importlib.util.spec_from_file_location("mx_mech_pybind", python_module)
    ext = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ext)
    torch.ops.load_library(str(_compile(folder, "mx_mech_ops.so", _BODY + _REGISTRATION, "c++", flags)))
    return noop, ext, torch.ops.mx_mech


def _compile(folder: Path, name: str, source: str, language: str, flags: list[str]) -> Path:
    src, out = folder / f"{name}.{'c' if language == 'c' else 'cpp'}", folder / name
    src.write_text(source)
    compiler = "gcc" if language == "c" else "g++"
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(src), *flags],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{compiler} failed on {name}:\n{done.stderr[-4000:]}")
    return out


def timed(f, n: int = 1000) -> float:
    """µs per call of ``n`` calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--k", type=int, default=128)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=41)
    args = parser.parse_args(argv)
    device, k, n = torch.device(args.device), args.k, args.n
    noop, ext, ns = build(Path(tempfile.mkdtemp(prefix="mx-mech-")))
    fn, address = noop.noop_run, ctypes.addressof(ctypes.c_int(0))
    ext_fn = ext.call
    op = ns.call.default

    def python_plan(x, weight, m):  # the small-M launcher's steps around a C function that returns at once
        def launch(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if not (x.is_contiguous() and x.data_ptr() % 16 == 0):
                x = x.clone(memory_format=torch.contiguous_format)
            y = torch.empty(m, n, dtype=torch.bfloat16, device=device)
            err = fn(address, x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), None)
            if err:
                raise RuntimeError(err)
            return y if x.dim() == 2 else y.resize_(*x.shape[:-1], n)

        return launch

    ops._plan = python_plan
    layer = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    model = torch.nn.Sequential(layer)
    mxgemm.quantize_model(model, backend="emulation", skip=(), fuse=False)
    mx = model[0].to(device)
    handle = id(mx)
    ext.add_plan(handle, ctypes.cast(fn, ctypes.c_void_p).value, 1, address, k, n)
    ns.add_plan(handle + 1, ctypes.cast(fn, ctypes.c_void_p).value, 1, address, k, n)

    class ViaPybind(torch.nn.Module):
        def forward(self, x):
            return ext_fn(x, None, handle)

    wrapped = ext.call_wrapped

    class ViaWrapped(torch.nn.Module):
        def forward(self, x):
            return wrapped(x, None, handle)

    class ViaOps(torch.nn.Module):
        def forward(self, x):
            return op(x, None, handle + 1)

    raw = op._op  # the C++ function OpOverload.__call__ wraps
    weight, generation = mx._prepared, tuning._GENERATION

    class Lean(torch.nn.Module):  # the checks the C++ function makes, in one Python function, then the plan
        def forward(self, x):
            if (type(x) is torch.Tensor and x.dtype is torch.bfloat16 and x.shape[-1] == k and x.device == device
                    and not torch.is_grad_enabled()):  # fmt: skip
                plan = weight.plans.launch.get((x.numel() // k, x.dtype, generation[0]))
                if plan is not None:
                    return plan(x, None)
            return mx(x)

    class ViaRawOp(torch.nn.Module):
        def forward(self, x):
            return raw(x, None, handle + 1)

    class Floor(torch.nn.Module):
        def forward(self, x):
            return x

    x = torch.randn(1, 1, k, dtype=torch.bfloat16, device=device)
    cases = {"python": mx, "lean python": Lean(), "pybind": ViaPybind(), "pybind wrapped": ViaWrapped(),
             "torch.ops": ViaOps(), "op._op": ViaRawOp(),
             "floor": Floor(), "empty": lambda x: torch.empty(1, n, dtype=torch.bfloat16, device=device)}  # fmt: skip
    results = {name: [] for name in cases}
    with torch.inference_mode():
        for name, f in cases.items():
            assert f(x).shape[-1] in (n, k), name
        for f in cases.values():
            timed(lambda f=f: f(x))  # warm-up
        for _ in range(args.rounds):  # the cases interleaved: the host's speed moves between seconds
            for name, f in cases.items():
                results[name].append(timed(lambda f=f: f(x)))
    print(f"host µs per call, device {device}, [1, 1, {k}] -> {n}; {args.rounds} rounds of 1000 calls each; python "
          f"{sys.version.split()[0]}, torch {torch.__version__}")  # fmt: skip
    print(f"{'':14s} {'min':>6s} {'median':>7s}")
    for name, ts in results.items():
        print(f"{name:14s} {min(ts):6.2f} {statistics.median(ts):7.2f}")


if __name__ == "__main__":
    main()
