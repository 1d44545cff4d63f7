"""Host time of one eager linear-layer call by the mechanism that carries it from the module to the launch, the
kernel itself replaced by a C function that returns at once (so it runs on any host, GPU or not):

- ``python``: today's path: ``MXFP8Linear.forward`` -> ``weights.linear`` -> ``ops.run_planned`` -> a launcher shaped
  like the small-M kernel's (``torch.empty``, one ctypes call with the plan's address and the call's pointers);
- ``lean python``: the checks that C++ function makes, in one Python ``forward``, then the plan;
- ``pybind``: ``forward`` calls one C++ function (a pybind11 extension) that checks the input, finds the plan for M,
  allocates the output with ``at::empty`` and calls the C function;
- ``torch.ops``: the same C++ body registered as an op (``TORCH_LIBRARY``) and called through ``torch.ops``;
  ``op._op``: the C++ function that op's Python wrapper (``OpOverload.__call__``) calls, called directly;
- ``floor``: a module whose ``forward`` returns its input; ``empty``: ``torch.empty`` of the output alone.

Each figure is the median of 7 timings of 5000 calls, [1, 1, K] activations, the mechanisms interleaved.

Run: python3 bench/explore/eager_mechanisms.py [--device cuda] (builds two small extensions with
torch.utils.cpp_extension: ninja and a C++ compiler, ~1-2 min the first time).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

import mxgemm
import mxgemm.ops as ops
from mxgemm import autotune

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


def build(folder: Path):
    """(the no-op C library, the pybind extension, the torch.ops namespace)."""
    src, lib = folder / "noop.c", folder / "libnoop.so"
    src.write_text(_NOOP_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    noop = ctypes.CDLL(str(lib))
    p = ctypes.c_void_p
    noop.noop_run.argtypes, noop.noop_run.restype = [p, p, p, p, p], ctypes.c_int
    ext = load_inline("mx_mech_pybind", cpp_sources=_BODY, functions=["add_plan", "call"],
                      build_directory=str(_mkdir(folder / "pybind")))  # fmt: skip
    load_inline("mx_mech_ops", cpp_sources=_BODY + _REGISTRATION, is_python_module=False,
                build_directory=str(_mkdir(folder / "ops")))  # fmt: skip
    return noop, ext, torch.ops.mx_mech


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def timed(f, n: int = 5000) -> float:
    """Median µs per call of 7 timings of ``n`` calls."""
    for _ in range(500):
        f()
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--k", type=int, default=128)
    parser.add_argument("--n", type=int, default=128)
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

    class ViaOps(torch.nn.Module):
        def forward(self, x):
            return op(x, None, handle + 1)

    raw = op._op  # the C++ function OpOverload.__call__ wraps
    weight, generation = mx._prepared, autotune._GENERATION

    class Lean(torch.nn.Module):  # the checks the C++ function makes, in one Python function, then the plan
        def forward(self, x):
            if (type(x) is torch.Tensor and x.dtype is torch.bfloat16 and x.shape[-1] == k and x.device == device
                    and not torch.is_grad_enabled()):  # fmt: skip
                plan = weight.plans.get((x.numel() // k, x.dtype, generation[0]))
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
    cases = {"python": mx, "lean python": Lean(), "pybind": ViaPybind(), "torch.ops": ViaOps(), "op._op": ViaRawOp(),
             "floor": Floor(), "empty": lambda x: torch.empty(1, n, dtype=torch.bfloat16, device=device)}  # fmt: skip
    results = {name: [] for name in cases}
    with torch.inference_mode():
        for name, f in cases.items():
            assert f(x).shape[-1] in (n, k), name
        for _ in range(3):
            for name, f in cases.items():
                results[name].append(timed(lambda f=f: f(x)))
    print(f"host µs per call, device {device}, [1, 1, {k}] -> {n}; python {sys.version.split()[0]}, torch "
          f"{torch.__version__}")  # fmt: skip
    for name, ts in results.items():
        print(f"{name:10s} {statistics.median(ts):6.2f}  ({', '.join(f'{t:.2f}' for t in ts)})")


if __name__ == "__main__":
    main()
