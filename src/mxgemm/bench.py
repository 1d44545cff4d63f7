"""``mxgemm bench``: mxgemm's backends against what users would run instead, on the machine in hand.

On a GPU every contender is timed as a CUDA graph with L2-cold weights (rotated copies, > 3x L2) and activation
quantization inside the timed region. On a CPU-only machine the emulation backend runs on small shapes against
bf16 ``F.linear``: a smoke run, labelled as such, not a measure of GPU speed.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .backends import backend_names
from .device import DeviceInfo, describe_device
from .format import MXTensor, dequantize, quantize
from .resolve import available_backends, explain_auto
from .timing import copies_for_cold_l2, time_cpu, time_cuda
from .weights import linear, prepare_weight

__all__ = ["DEFAULT_M", "MODELS", "BenchRow", "Problem", "environment", "parse_shapes", "run_bench"]

# (N, K, name) of the dense projections
MODELS: dict[str, list[tuple[int, int, str]]] = {
    "llama3-8b": [(6144, 4096, "qkv"), (4096, 4096, "o"), (28672, 4096, "gate_up"), (4096, 14336, "down")],
    "llama3-70b": [(10240, 8192, "qkv"), (8192, 8192, "o"), (57344, 8192, "gate_up"), (8192, 28672, "down")],
    "hidden-7168": [(9216, 7168, "qkv"), (7168, 7168, "o"), (36864, 7168, "gate_up"), (7168, 18432, "down")],
}
DEFAULT_M = (1, 4, 16, 64, 256, 1024, 4096, 8192)
CPU_SHAPES = [(256, 512, "cpu-small"), (512, 1024, "cpu-medium")]
CPU_M = (1, 16, 64)

# Ceilings of the floor, measured on the H200 (DESIGN.md): copy bandwidth and FP8 tensorwise GEMM rate.
FLOOR_CEILINGS: dict[str, tuple[float, float]] = {"H200": (4.26e12, 1288e12)}


@dataclass(frozen=True)
class Problem:
    m: int
    n: int
    k: int
    name: str = ""

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def mx_bytes(self) -> int:
        """Bytes an MXFP8 GEMM must move: the weight with its scales, bf16 activations in and out."""
        return self.n * self.k + self.n * self.k // 32 + 2 * self.m * self.k + 2 * self.m * self.n


@dataclass
class BenchRow:
    M: int
    N: int
    K: int
    name: str
    backend: str  # what `auto` chose
    floor_us: float | None
    us: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"MxNxK,MxNxK"`` -> [(M, N, K), ...]."""
    shapes = []
    for item in text.split(","):
        parts = item.lower().strip().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"shape {item!r} is not of the form MxNxK")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def environment(device: DeviceInfo) -> dict[str, object]:
    import importlib.metadata as md

    def version(pkg: str) -> str | None:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    from . import __version__

    return {
        "name": device.name or device.type,
        "type": device.type,
        "sm": device.sm,
        "mxgemm": __version__,
        "torch": torch.__version__,
        "triton": version("triton"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def floor_us(p: Problem, device: DeviceInfo) -> float | None:
    for key, (bandwidth, fp8_rate) in FLOOR_CEILINGS.items():
        if key in (device.name or ""):
            return max(p.mx_bytes / bandwidth, p.flops / fp8_rate) * 1e6
    return None


def _mx_weight(n: int, k: int, device: torch.device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    t = quantize(w.to(device))
    return t.qdata, t.scale


def _time(calls: Sequence[Callable[[], object]], device: DeviceInfo, heavy: bool) -> float:
    if device.type == "cuda":
        return time_cuda(calls, replays=3 if heavy else 20, min_calls_per_replay=2 if heavy else 20)
    return time_cpu(calls[0])


def run_bench(
    shapes: Sequence[tuple[int, int, int, str]],
    *,
    backends: Sequence[str] | None = None,
    emulation_max_flops: float = 2e11,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, object], list[BenchRow]]:
    """Time ``shapes`` [(M, N, K, name)] on the current device; returns (environment, rows)."""
    device = describe_device()
    dev = device.torch_device
    usable = [s.name for s in available_backends(device) if s.available]
    wanted = [b for b in (backends or backend_names()) if b in usable]
    rows: list[BenchRow] = []
    weight_cache: dict[tuple[int, int], list] = {}
    for m, n, k, name in shapes:
        p = Problem(m, n, k, name)
        if progress:
            progress(f"M={m} N={n} K={k} {name}")
        auto = explain_auto(device, shape=(n, k)).backend.name
        row = BenchRow(m, n, k, name, auto, floor_us(p, device))
        copies = copies_for_cold_l2(2 * n * k, device.l2_bytes) if device.type == "cuda" else 1
        if (n, k) not in weight_cache:
            weight_cache.clear()
            weight_cache[(n, k)] = [_mx_weight(n, k, dev, seed) for seed in range(copies)]
        weights = weight_cache[(n, k)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)

        bf16_w = [dequantize(MXTensor(q, s), torch.bfloat16) for q, s in weights]
        row.us["bf16"] = _time([lambda w=w, x=x: F.linear(x, w) for w in bf16_w], device, heavy=False)
        del bf16_w
        for b in wanted:
            heavy = b == "emulation"
            if heavy and p.flops > emulation_max_flops:
                row.us[b] = None
                row.notes.append(f"{b} skipped above {emulation_max_flops:.0e} flops")
                continue
            use = weights[:2] if heavy else weights
            prepared = [prepare_weight(q, s, backend=b) for q, s in use]
            row.us[b] = _time([lambda w=w, x=x: linear(x, w) for w in prepared], device, heavy)
        row.us["mxgemm"] = row.us.get(auto)
        rows.append(row)
    return environment(device), rows


def write_json(path: str, env: dict[str, object], rows: Sequence[BenchRow], command: str) -> None:
    with open(path, "w") as f:
        json.dump({"command": command, "device": env, "rows": [asdict(r) for r in rows]}, f, indent=1)


def table_rows(rows: Sequence[BenchRow]) -> tuple[list[str], list[list[str]]]:
    """Header and cells: µs of each contender, then mxgemm's TFLOP/s, GB/s, speedup over bf16, % of floor."""
    contenders = [c for c in dict.fromkeys(k for r in rows for k in r.us) if c != "mxgemm"]
    header = ["M", "N", "K", "shape", "auto", "floor µs", "mxgemm µs", *[f"{c} µs" for c in contenders]]
    header += ["TFLOP/s", "GB/s", "x bf16", "% floor"]
    out = []
    for r in rows:
        p = Problem(r.M, r.N, r.K)
        t = r.us.get("mxgemm")

        def fmt(v: float | None, spec: str = ".1f") -> str:
            return "-" if v is None else format(v, spec)

        cells = [str(r.M), str(r.N), str(r.K), r.name, r.backend, fmt(r.floor_us), fmt(t)]
        cells += [fmt(r.us.get(c)) for c in contenders]
        if t:
            bf16 = r.us.get("bf16")
            cells += [
                fmt(p.flops / t / 1e6),
                fmt(p.mx_bytes / t / 1e3, ".0f"),
                fmt(bf16 / t if bf16 else None, ".2f"),
                fmt(100 * r.floor_us / t if r.floor_us else None, ".0f"),
            ]
        else:
            cells += ["-"] * 4
        out.append(cells)
    return header, out


def markdown_table(rows: Sequence[BenchRow]) -> str:
    header, cells = table_rows(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines) + "\n"
