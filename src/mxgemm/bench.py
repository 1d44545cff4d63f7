"""``mxgemm bench``: mxgemm against what users would run instead, on the machine in hand.

On a GPU, side by side in one run (each timed as a CUDA graph, weights rotated through copies larger than 3x the L2,
activation quantization inside the timed region where a recipe has it):

* ``mxgemm``: what ``auto`` picks for the weight; each available mxgemm backend by name;
* ``bf16``: ``F.linear`` on the dequantized weight (what engines do when they upcast);
* ``fp8_rowwise``: ``torch._scaled_mm`` with row/column scales, GEMM only: the FP8 ceiling without MX semantics;
* ``dot_scaled``: Triton's ``tl.dot_scaled`` (bf16 x MXFP8), best of a config sweep, run in a child process because
  some configs fault on SM90 (a faulting shape is reported, not fatal);
* ``emulation``: per-call emulation (skipped above a flop budget);
* the floor: max(bytes / copy bandwidth, flops / FP8 rate), from the H200's measured ceilings.

On a CPU-only machine the emulation backend runs on small shapes against bf16 ``F.linear``: a smoke run, labelled as
such, not a measure of GPU speed.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .autotune import tuner_for
from .backends import get_backend
from .backends.base import tactic_json
from .device import DeviceInfo, describe_device
from .format import MXTensor, dequantize, quantize
from .resolve import available_backends
from .timing import SETTLE_MS, copies_for_cold_l2, time_cpu, time_cuda
from .weights import linear, prepare_weight

__all__ = [
    "DEFAULT_M",
    "MODELS",
    "BenchRow",
    "Problem",
    "bench_record",
    "environment",
    "mx_weights",
    "parse_shapes",
    "run_bench",
]

# (N, K, name) of the dense projections
MODELS: dict[str, list[tuple[int, int, str]]] = {
    "llama3-8b": [(6144, 4096, "qkv"), (4096, 4096, "o"), (28672, 4096, "gate_up"), (4096, 14336, "down")],
    "llama3-70b": [(10240, 8192, "qkv"), (8192, 8192, "o"), (57344, 8192, "gate_up"), (8192, 28672, "down")],
    "hidden-7168": [(9216, 7168, "qkv"), (7168, 7168, "o"), (36864, 7168, "gate_up"), (7168, 18432, "down")],
    # Hugging Face's Llama keeps q/k/v and gate/up apart: the layers its generate runs
    "llama3-8b-hf": [
        (4096, 4096, "q,o"),
        (1024, 4096, "k,v"),
        (14336, 4096, "gate,up"),
        (4096, 14336, "down"),
        (128256, 4096, "lm_head"),
    ],
}
DEFAULT_M = (1, 4, 16, 64, 256, 1024, 4096, 8192)
CPU_SHAPES = [(256, 512, "cpu-small"), (512, 1024, "cpu-medium")]
CPU_M = (1, 16, 64)
BASELINES = ("bf16", "fp8_rowwise", "dot_scaled")

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
    backend: str  # what `auto` chose for this weight
    floor_us: float | None
    tactic: Any = None  # the tactic auto's calls ran with, as a tuning file records it (None: the backend's default)
    tactic_source: str = "default"  # where it came from: "cache" (the user's), "shipped" (the package's), "default"
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


def mx_weights(n: int, k: int, device: torch.device, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for seed in range(copies):
        g = torch.Generator(device="cpu").manual_seed(seed)
        t = quantize((torch.randn(n, k, generator=g) * 0.02).to(device))
        out.append((t.qdata, t.scale))
    return out


def _time(calls: Sequence[Callable[[], object]], device: DeviceInfo) -> float:
    """Each contender's operands are made just before it is timed: every one settles for ``SETTLE_MS`` first."""
    return time_cuda(calls, warmup_ms=SETTLE_MS) if device.type == "cuda" else time_cpu(calls[0])


def _fp8_rowwise_calls(x: torch.Tensor, weights) -> list[Callable[[], object]]:
    m, n = x.shape[0], weights[0][0].shape[0]
    xq = x.to(torch.float8_e4m3fn)
    sx = torch.ones(m, 1, device=x.device)
    sw = torch.ones(1, n, device=x.device)
    return [lambda q=q: torch._scaled_mm(xq, q.t(), sx, sw, out_dtype=torch.bfloat16) for q, _ in weights]


class DotScaledRunner:
    """Times Triton ``dot_scaled`` in a child process, so that a faulting config loses one shape, not the run."""

    def __init__(self) -> None:
        self._proc = None
        self._conn = None

    def _start(self) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_dot_scaled_worker, args=(child,), daemon=True)
        self._proc.start()

    def time(self, m: int, n: int, k: int, timeout: float = 300.0) -> tuple[float | None, str]:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send((m, n, k))
        if self._conn.poll(timeout):
            try:
                return self._conn.recv()
            except EOFError:
                pass
        code = self._proc.exitcode
        self._proc.kill()
        self._proc = None
        return None, f"dot_scaled faulted at M={m} N={n} K={k} (child exit code {code}); skipped"

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(10)


def _dot_scaled_worker(conn) -> None:
    from .kernels.dot_scaled_ref import DOT_SCALED_CONFIGS, dot_scaled_linear

    device = describe_device()
    while (task := conn.recv()) is not None:
        m, n, k = task
        weights = mx_weights(n, k, device.torch_device, copies_for_cold_l2(n * k, device.l2_bytes))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q0, s0 = weights[0]
        ref = x.float() @ dequantize(MXTensor(q0, s0)).T
        best, notes, settle = None, [], SETTLE_MS  # the weights are new for the first config timed
        for cfg in DOT_SCALED_CONFIGS:
            if (m <= 64) != (cfg["BM"] <= 64) and m not in (64, 256):
                continue  # the sweep a tuner would prune: small tiles for small M, large for large
            y = dot_scaled_linear(x, q0, s0, cfg).float()
            if not (y - ref).norm() <= 1e-2 * ref.norm():
                notes.append(f"config {cfg} gave wrong results")
                continue
            calls = [lambda q=q, s=s, c=cfg, x=x: dot_scaled_linear(x, q, s, c) for q, s in weights]
            us, settle = time_cuda(calls, warmup_ms=settle), 0.0
            best = us if best is None else min(best, us)
        conn.send((best, "; ".join(notes)))


def _time_dot_scaled(rows: Sequence[BenchRow], runner, progress: Callable[[str], None] | None) -> None:
    """``dot_scaled``'s sweeps for every row, in a pass of their own after every other contender: the contender timed
    right after a sweep ran 15-20% slow on the H200)."""
    for row in rows:
        if progress:
            progress(f"dot_scaled M={row.M} N={row.N} K={row.K}")
        row.us["dot_scaled"], note = runner.time(row.M, row.N, row.K)
        if note:
            row.notes.append(note)


def run_bench(
    shapes: Sequence[tuple[int, int, int, str]],
    *,
    backends: Sequence[str] | None = None,
    baselines: Sequence[str] = BASELINES,
    emulation_max_flops: float = 2e11,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, object], list[BenchRow]]:
    """Time ``shapes`` [(M, N, K, name)] on the current device; returns (environment, rows)."""
    device = describe_device()
    dev = device.torch_device
    on_gpu = device.type == "cuda"
    usable = [s.name for s in available_backends(device) if s.available]
    wanted = [b for b in (backends or usable) if b in usable]
    rows: list[BenchRow] = []
    cache: dict[tuple[int, int], list] = {}
    dot_scaled = DotScaledRunner() if on_gpu and "dot_scaled" in baselines else None
    try:
        for m, n, k, name in shapes:
            p = Problem(m, n, k, name)
            if progress:
                progress(f"M={m} N={n} K={k} {name}")
            if (n, k) not in cache:
                cache.clear()
                cache[(n, k)] = mx_weights(n, k, dev, copies_for_cold_l2(2 * n * k, device.l2_bytes) if on_gpu else 1)
            weights = cache[(n, k)]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            auto = [prepare_weight(q, s) for q, s in weights]
            row = BenchRow(m, n, k, name, auto[0].backend, floor_us(p, device))
            tactic, row.tactic_source = tuner_for(dev).choice(get_backend(row.backend), auto[0], m, x.dtype)
            row.tactic = tactic_json(tactic)
            row.us["mxgemm"] = _time([lambda w=w, x=x: linear(x, w) for w in auto], device)
            del auto
            for b in wanted:
                if not on_gpu and b == row.backend:
                    continue  # the "mxgemm" column already is this backend's time
                if b == "emulation" and p.flops > emulation_max_flops:
                    row.us[b] = None
                    row.notes.append(f"emulation skipped above {emulation_max_flops:.0e} flops")
                    continue
                use = weights[:2] if b == "emulation" else weights
                prepared = [prepare_weight(q, s, backend=b) for q, s in use]
                row.us[b] = _time([lambda w=w, x=x: linear(x, w) for w in prepared], device)
            bf16 = [dequantize(MXTensor(q, s), torch.bfloat16) for q, s in weights]
            row.us["bf16"] = _time([lambda w=w, x=x: F.linear(x, w) for w in bf16], device)
            del bf16
            if on_gpu and "fp8_rowwise" in baselines:
                row.us["fp8_rowwise"] = _time(_fp8_rowwise_calls(x, weights), device)
            rows.append(row)
        if dot_scaled is not None:
            _time_dot_scaled(rows, dot_scaled, progress)
    finally:
        if dot_scaled is not None:
            dot_scaled.close()
    return environment(device), rows


def bench_record(env: dict[str, object], rows: Sequence[BenchRow], command: str) -> dict:
    """What ``--json`` writes: the command, the device's environment and every row."""
    return {"command": command, "device": env, "rows": [asdict(r) for r in rows]}


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


NARROW = ("M", "N", "K", "shape", "auto", "mxgemm µs", "bf16 µs", "x bf16", "% floor")  # a terminal's 80 columns


def table_rows(
    rows: Sequence[BenchRow], *, smoke: bool = False, wide: bool = True
) -> tuple[list[str], list[list[str]]]:
    """Header and cells: µs of each contender, then mxgemm's TFLOP/s, GB/s, speedup over bf16, % of floor; columns
    empty on every row left out. ``smoke`` (a CPU run): no rates, which say nothing there. ``wide``: every column,
    else only ``NARROW``'s."""
    contenders = list(dict.fromkeys(c for r in rows for c in r.us))
    header = ["M", "N", "K", "shape", "auto", "tactic", "floor µs", *[f"{c} µs" for c in contenders]]
    header += ["TFLOP/s", "GB/s", "x bf16", "x dot_scaled", "% floor"]
    out = []
    for r in rows:
        p = Problem(r.M, r.N, r.K)
        t = r.us.get("mxgemm")
        cells = [str(r.M), str(r.N), str(r.K), r.name, r.backend, r.tactic_source, _fmt(r.floor_us)]
        cells += [_fmt(r.us.get(c)) for c in contenders]
        if t:
            bf16, ds = r.us.get("bf16"), r.us.get("dot_scaled")
            cells += [
                "-" if smoke else _fmt(p.flops / t / 1e6),
                "-" if smoke else _fmt(p.mx_bytes / t / 1e3, ".0f"),
                _fmt(bf16 / t if bf16 else None, ".2f"),
                _fmt(ds / t if ds else None, ".2f"),
                _fmt(100 * r.floor_us / t if r.floor_us else None, ".0f"),
            ]
        else:
            cells += ["-"] * 5
        out.append(cells)
    keep = [i for i in range(len(header)) if any(c[i] != "-" for c in out)] if out else range(len(header))
    keep = [i for i in keep if wide or header[i] in NARROW]
    return [header[i] for i in keep], [[c[i] for i in keep] for c in out]


def markdown_table(rows: Sequence[BenchRow], *, smoke: bool = False) -> str:
    header, cells = table_rows(rows, smoke=smoke)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    notes = [f"- M={r.M} N={r.N} K={r.K}: {n}" for r in rows for n in r.notes]
    return "\n".join(lines) + "\n" + ("\nNotes:\n" + "\n".join(notes) + "\n" if notes else "")


def plot(rows: Sequence[BenchRow], path: str) -> None:
    """Speedup over bf16 against M, one panel per weight shape (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys((r.N, r.K, r.name) for r in rows))
    cols = min(4, len(shapes))
    nrows = -(-len(shapes) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    contenders = [c for c in dict.fromkeys(c for r in rows for c in r.us) if c != "bf16"]
    for ax, (n, k, name) in zip(axes.flat, shapes, strict=False):
        sub = [r for r in rows if (r.N, r.K) == (n, k)]
        for c in contenders:
            pts = [(r.M, r.us["bf16"] / r.us[c]) for r in sub if r.us.get(c) and r.us.get("bf16")]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=c)
        floor = [(r.M, r.us["bf16"] / r.floor_us) for r in sub if r.floor_us and r.us.get("bf16")]
        if floor:
            ax.plot(*zip(*floor, strict=True), "k--", label="floor")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_title(f"{name} N={n} K={k}")
        ax.set_xlabel("M")
        ax.set_ylabel("speedup over bf16")
    for ax in axes.flat[len(shapes) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
