"""``mxgemm bench --moe``: the grouped GEMMs of mixture-of-experts projections against what users would run instead.

On a GPU, each time a CUDA-graph replay of ``ROUTINGS`` routings of the same token count (uniform top-k, a new draw
each), so that the active experts change from call to call and their weights do not stay in L2:

* ``mxgemm``: ``grouped_linear`` on the experts prepared by ``auto``, activation quantization included;
* ``bf16``: ``torch._grouped_mm`` on the dequantized experts (what engines run for bf16 experts);
* ``fp8_rowwise``: ``torch._scaled_grouped_mm`` with row/column scales, GEMM only (activations quantized beforehand);
* ``deepgemm_masked`` / ``deepgemm_contiguous``, where ``deep_gemm`` imports (the SM90 kernels of the w8a8-block recipe,
  on the very experts ``auto`` prepared where they are 128x128-block ones): GEMM only, activations quantized
  beforehand; masked with each expert's rows in a slot of the most rows any expert gets, contiguous with each expert's
  rows padded to DeepGEMM's alignment (128) as its layout asks;
* the floor: the active experts' FP8 and scale bytes over the copy bandwidth, measured first (a 1 GiB
  device-to-device copy, bytes read plus written).

and the whole routed block (``proj`` "block": ``moe_experts``, gather, gate/up, SiLU and product, down, weighted
combine) against transformers' bf16 Qwen3-MoE experts module with its ``grouped_mm`` implementation.

On a CPU-only machine ``auto``'s grouped backend runs tiny experts against bf16 ``torch._grouped_mm``: a smoke run,
labelled as such, not a measure of GPU speed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

from .device import describe_device
from .format import MXTensor, dequantize, quantize
from .grouped import grouped_linear, prepare_grouped_weight
from .timing import time_cpu, time_cuda

__all__ = [
    "MOE_MODELS",
    "MOE_TOKENS",
    "MoeRow",
    "bench_record",
    "deepgemm_calls",
    "deepgemm_prebuild",
    "experts_with_bf16",
    "hf_experts",
    "markdown_table",
    "random_experts",
    "routing_counts",
    "routing_offsets",
    "run_moe_bench",
    "table_rows",
    "top_k_routing",
]

# (experts, hidden, expert width, top-k)
MOE_MODELS: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "deepseek-v3": (256, 7168, 2048, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
}
MOE_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
CPU_MODEL = ("cpu-tiny", (8, 256, 128, 2))
CPU_TOKENS = (1, 4, 16)
ROUTINGS = 8
FP8_BYTES_PER_PARAMETER = 1 + 4 / 128**2  # an element, and its share of a 128x128 block's fp32 scale


@dataclass
class MoeRow:
    model: str
    proj: str
    E: int
    N: int
    K: int
    tokens: int
    active: float  # experts with rows, averaged over the routings
    backend: str
    floor_us: float | None
    us: dict[str, float | None] = field(default_factory=dict)
    rel_err_vs_bf16: float = 0.0


def random_experts(e: int, n: int, k: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MX experts ``[E, N, K]`` (float8 elements, uint8 E8M0 scales), made one expert at a time."""
    q = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty((e, n, k // 32), dtype=torch.uint8, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for i in range(e):
        t = quantize(torch.randn(n, k, generator=g, device=device) * 0.02)
        q[i], s[i] = t.qdata, t.scale
    return q, s


def experts_with_bf16(e: int, n: int, k: int, seed: int, device: torch.device):
    """:func:`random_experts` and their bf16 values."""
    q, s = random_experts(e, n, k, seed, device)
    w = torch.empty((e, n, k), dtype=torch.bfloat16, device=device)
    for i in range(e):
        w[i] = dequantize(MXTensor(q[i], s[i])).to(torch.bfloat16)
    return q, s, w


def routing_offsets(tokens: int, e: int, topk: int, seed: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """int32 cumulative row ends of :func:`top_k_routing`'s routing, and how many experts it makes active."""
    counts = torch.tensor(routing_counts(tokens, e, topk, seed))
    return counts.cumsum(0).to(torch.int32).to(device), int((counts > 0).sum())


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = x.float().abs().amax(dim=1).clamp_min(1e-12)
    return (x.float() * (448.0 / amax)[:, None]).to(torch.float8_e4m3fn), amax / 448.0


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, read plus written."""
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / (time_cuda([partial(dst.copy_, src)]) * 1e-6)


def hf_experts(e: int, hidden: int, width: int, topk: int, gate_up: torch.Tensor, down: torch.Tensor):
    """transformers' bf16 Qwen3-MoE experts module on these weights, with its ``grouped_mm`` implementation; None
    without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden, moe_intermediate_size=width, num_experts=e, num_experts_per_tok=topk
    )
    config._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        module = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    module.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    module.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return module


def _deepgemm_layout(per_expert: list[int], align: int) -> tuple[int, list[int], int]:
    """DeepGEMM's layouts of one routing's rows per expert: the masked slot (the most rows any expert gets, rounded up
    to 256, the largest row block the masked kernel picks, of which its slot must be a multiple), each expert's rows
    padded to ``align`` for the contiguous layout, and the masked kernel's hint of rows per active expert."""
    slot = max(-(-max(per_expert) // 256) * 256, 256)
    padded = [-(-c // align) * align for c in per_expert]
    expected_m = max(1, round(sum(per_expert) / max(1, sum(c > 0 for c in per_expert))))
    return slot, padded, expected_m


def deepgemm_calls(
    weight, counts: Sequence[list[int]], k: int, device: torch.device, deep_gemm=None
) -> dict[str, list[Callable]]:
    """DeepGEMM's grouped GEMMs on ``weight``'s experts (its ``qdata`` E4M3 ``[E, N, K]`` and fp32 ``block_scale``
    ``[E, ceil(N/128), ceil(K/128)]``: DeepGEMM's own RHS format) for each routing's rows per expert ``counts``, the
    activations random and quantized per 1x128 beforehand; {} where ``deep_gemm`` does not import or the experts are
    in another format."""
    if deep_gemm is None:
        deep_gemm = _import_deepgemm()
        if deep_gemm is None:
            return {}
    from .block128 import quantize_1x128

    t = weight.tensors
    if "block_scale" not in t or t["qdata"].dtype != torch.float8_e4m3fn:
        return {}
    rhs = (t["qdata"], t["block_scale"])
    n = weight.out_features
    align = deep_gemm.get_m_alignment_for_contiguous_layout()
    calls: dict[str, list[Callable]] = {"deepgemm_masked": [], "deepgemm_contiguous": []}
    for per_expert in counts:
        slot, padded, expected_m = _deepgemm_layout(per_expert, align)
        xq, xs = quantize_1x128(torch.randn(len(per_expert) * slot, k, device=device).bfloat16())
        xq, xs = xq.view(len(per_expert), slot, k), xs.view(len(per_expert), slot, -1)
        masked_m = torch.tensor(per_expert, dtype=torch.int32, device=device)
        masked_lhs = (xq, deep_gemm.get_col_major_tma_aligned_tensor(xs))
        out = torch.empty(len(per_expert), slot, n, dtype=torch.bfloat16, device=device)
        calls["deepgemm_masked"].append(
            partial(deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_masked, masked_lhs, rhs, out, masked_m, expected_m)
        )
        rows = torch.cat([torch.arange(c, device=device) + i * slot for i, c in enumerate(padded)])
        lhs = (xq.reshape(-1, k)[rows].contiguous(), xs.reshape(-1, xs.shape[-1])[rows].contiguous())
        m_indices = torch.repeat_interleave(
            torch.arange(len(padded), dtype=torch.int32, device=device), torch.tensor(padded, device=device)
        )
        flat_out = torch.empty(rows.numel(), n, dtype=torch.bfloat16, device=device)
        calls["deepgemm_contiguous"].append(
            partial(deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous, lhs, rhs, flat_out, m_indices)
        )
    return calls


def _import_deepgemm():
    try:
        import deep_gemm
    except ImportError:
        return None
    return deep_gemm


def deepgemm_prebuild(problems: Sequence[tuple[int, int, int, list[int]]], jobs: int, deep_gemm=None) -> int:
    """Build, ``jobs`` compilers at once, every kernel that :func:`deepgemm_calls` would make DeepGEMM's JIT compile one
    after another on first use, for these (E, N, K, rows per expert) problems: the same calls run on meta tensors
    while DeepGEMM's tuner records each kernel's code instead of building it. Returns how many kernels were built;
    0 where ``deep_gemm`` does not import or has no such JIT (other versions than the anchors' d374456)."""
    deep_gemm = deep_gemm or _import_deepgemm()
    try:
        from deep_gemm.jit import build, cpp_format, generate
        from deep_gemm.jit_kernels.tuner import jit_tuner
    except ImportError:
        return 0
    from concurrent.futures import ThreadPoolExecutor

    wanted: dict[str, tuple[str, tuple]] = {}

    def record(name, keys, space, includes, arg_defs, template, args):
        code = generate(includes, arg_defs, cpp_format(template, {k: keys[k] for k in sorted(keys)}))
        wanted[code] = (name, arg_defs)
        return lambda *a: 0

    meta = torch.device("meta")
    fp8 = torch.float8_e4m3fn
    align = deep_gemm.get_m_alignment_for_contiguous_layout()
    jit_tuner.compile_and_tune = record  # the instance's attribute shadows the method until deleted
    try:
        for e, n, k, per_expert in dict.fromkeys((e, n, k, tuple(c)) for e, n, k, c in problems):
            slot, padded, expected_m = _deepgemm_layout(per_expert, align)
            m, kb = sum(padded), -(-k // 128)
            rhs = (torch.empty(e, n, k, dtype=fp8, device=meta), torch.empty(e, -(-n // 128), kb, device=meta))
            masked = (
                (torch.empty(e, slot, k, dtype=fp8, device=meta), torch.empty(e, slot, kb, device=meta)),
                rhs,
                torch.empty(e, slot, n, dtype=torch.bfloat16, device=meta),
                torch.empty(e, dtype=torch.int32, device=meta),
                expected_m,
            )
            contiguous = (
                (torch.empty(m, k, dtype=fp8, device=meta), torch.empty(m, kb, device=meta)),
                rhs,
                torch.empty(m, n, dtype=torch.bfloat16, device=meta),
                torch.empty(m, dtype=torch.int32, device=meta),
            )
            for fn, args in (
                (deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_masked, masked),
                (deep_gemm.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous, contiguous),
            ):
                try:
                    fn(*args)
                except Exception:  # a problem it refuses: its timed call fails too, and leaves its cell empty
                    continue
    finally:
        del jit_tuner.compile_and_tune

    def built(item) -> bool:
        code, (name, arg_defs) = item
        try:
            build(name, arg_defs, code)
        except Exception:  # built again on first use, where the failure empties the cell
            return False
        return True

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return sum(pool.map(built, wanted.items()))


def routing_counts(tokens: int, e: int, topk: int, seed: int) -> list[int]:
    """The rows per expert of :func:`top_k_routing`'s routing."""
    ids, _ = top_k_routing(tokens, e, topk, seed, torch.device("cpu"))
    return torch.bincount(ids.reshape(-1), minlength=e).tolist()


def top_k_routing(tokens: int, e: int, topk: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A uniform top-k routing: expert ids [T, k] and softmaxed weights [T, k]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, e, generator=g).topk(topk, dim=1).indices
    return ids.to(device), torch.rand(tokens, topk, generator=g).softmax(-1).bfloat16().to(device)


def run_moe_bench(
    models: Sequence[str] | None = None,
    tokens: Sequence[int] | None = None,
    *,
    progress: Callable[[str], None] = lambda s: None,
) -> tuple[dict, list[MoeRow]]:
    """Time both projections of each model's experts and the whole routed block at each token count;
    (environment, rows)."""
    from .bench import environment
    from .moe import moe_experts

    device = describe_device()
    gpu = device.type == "cuda"
    if gpu:
        chosen = [(m, MOE_MODELS[m]) for m in (models or MOE_MODELS)]
        counts = tokens or MOE_TOKENS
        bandwidth = copy_bandwidth()
    else:
        chosen, counts, bandwidth = [CPU_MODEL], CPU_TOKENS, None
    env = {**environment(device), "copy_bytes_per_s": bandwidth, "routings_per_graph": ROUTINGS}
    dev = torch.device("cuda" if gpu else "cpu")
    rows = []
    if gpu and _import_deepgemm() is not None:
        start = time.perf_counter()
        problems = [
            (e, n, k, routing_counts(t, e, topk, seed=r))
            for _, (e, hidden, width, topk) in chosen
            for n, k in ((2 * width, hidden), (hidden, width))
            for t in counts
            for r in range(ROUTINGS)
        ]
        built = deepgemm_prebuild(problems, jobs=os.cpu_count() or 1)
        progress(f"DeepGEMM: {built} kernels built in {time.perf_counter() - start:.0f} s")

    def timed(row: MoeRow, calls: dict[str, list[Callable]]) -> None:
        for name, fns in calls.items():
            try:
                row.us[name] = time_cuda(fns, warmup_ms=50) if gpu else time_cpu(fns[0])
            except Exception as exc:  # DeepGEMM's calls only: a reference that fails leaves its cell empty
                if not name.startswith("deepgemm"):
                    raise
                row.us[name] = None
                progress(f"{row.model} {row.proj} tokens={row.tokens}: {name} failed: {str(exc)[:200]}")
        progress(f"{row.model} {row.proj} tokens={row.tokens}: {row.us}")
        rows.append(row)

    for model, (e, hidden, width, topk) in chosen:
        prepared, bf16_weights = {}, {}
        for proj, (n, k) in (("gate_up", (2 * width, hidden)), ("down", (hidden, width))):
            q, s, w16 = experts_with_bf16(e, n, k, seed=n + k, device=dev)
            prepared[proj], bf16_weights[proj] = prepare_grouped_weight(q, s), w16
            del q, s
            w16_t = w16.transpose(1, 2)  # [E, K, N], as _grouped_mm takes it
            w8 = w16.to(torch.float8_e4m3fn).transpose(1, 2) if gpu else None
            for t in counts:
                routings = [routing_offsets(t, e, topk, seed=r, device=dev) for r in range(ROUTINGS if gpu else 1)]
                offs = [o for o, _ in routings]
                xs = [torch.randn(t * topk, k, device=dev).bfloat16() for _ in offs]
                ours = [partial(grouped_linear, x, prepared[proj], o) for x, o in zip(xs, offs, strict=True)]
                bf16 = [partial(torch._grouped_mm, x, w16_t, offs=o) for x, o in zip(xs, offs, strict=True)]
                y, ref = ours[0](), bf16[0]().float()
                err = ((y.float() - ref).norm() / ref.norm()).item()
                active = sum(a for _, a in routings) / len(routings)
                floor = active * n * k * FP8_BYTES_PER_PARAMETER / bandwidth * 1e6 if bandwidth else None
                row = MoeRow(model, proj, e, n, k, t, active, prepared[proj].backend, floor, rel_err_vs_bf16=err)
                calls = {"mxgemm": ours, "bf16": bf16}
                if gpu:
                    quantized = [_rowwise(x) for x in xs]
                    scale_b = torch.ones(e, n, device=dev)
                    calls["fp8_rowwise"] = [
                        partial(torch._scaled_grouped_mm, xq, w8, xs_, scale_b, offs=o, out_dtype=torch.bfloat16)
                        for (xq, xs_), o in zip(quantized, offs, strict=True)
                    ]
                    per_expert = [routing_counts(t, e, topk, seed=r) for r in range(len(routings))]
                    calls |= deepgemm_calls(prepared[proj], per_expert, k, dev)
                timed(row, calls)
            del w16_t, w8
        hf = hf_experts(e, hidden, width, topk, bf16_weights["gate_up"], bf16_weights["down"])
        for t in counts:
            picks = [top_k_routing(t, e, topk, seed=r, device=dev) for r in range(ROUTINGS if gpu else 1)]
            xs = [torch.randn(t, hidden, device=dev).bfloat16() for _ in picks]
            gate_up, down = prepared["gate_up"], prepared["down"]
            ours = [partial(moe_experts, x, i, w, gate_up, down) for x, (i, w) in zip(xs, picks, strict=True)]
            calls = {"mxgemm": ours}
            err = 0.0
            if hf is not None:
                calls["bf16"] = [partial(hf, x, i, w) for x, (i, w) in zip(xs, picks, strict=True)]
                y, ref = ours[0]().float(), calls["bf16"][0]().float()
                err = ((y - ref).norm() / ref.norm()).item()
            active = sum(int(torch.unique(i).numel()) for i, _ in picks) / len(picks)
            weight_bytes = 3 * hidden * width * FP8_BYTES_PER_PARAMETER
            floor = active * weight_bytes / bandwidth * 1e6 if bandwidth else None
            row = MoeRow(model, "block", e, hidden, width, t, active, gate_up.backend, floor, rel_err_vs_bf16=err)
            timed(row, calls)
        del prepared, bf16_weights, hf
        if gpu:
            torch.cuda.empty_cache()
    return env, rows


COLUMNS = ["model", "proj", "tokens", "active experts", "backend", "floor µs", "mxgemm µs", "bf16 µs"]
COLUMNS += ["FP8 rowwise µs", "DeepGEMM masked µs", "DeepGEMM contiguous µs", "/ floor", "bf16 / mxgemm"]


def table_rows(rows: Sequence[MoeRow]) -> tuple[list[str], list[list[str]]]:
    """Header and cells, one row of strings per bench row; columns empty on every row (a CPU run's floor and FP8
    rowwise) left out."""

    def us(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    out = []
    for r in rows:
        ours, bf16 = r.us["mxgemm"], r.us["bf16"]
        over_floor = f"{ours / r.floor_us:.2f}" if ours and r.floor_us else "-"
        speedup = f"{bf16 / ours:.2f}" if ours and bf16 else "-"
        cells = [r.model, r.proj, str(r.tokens), f"{r.active:.1f}", r.backend, us(r.floor_us), us(ours), us(bf16)]
        anchors = [us(r.us.get(name)) for name in ("fp8_rowwise", "deepgemm_masked", "deepgemm_contiguous")]
        out.append([*cells, *anchors, over_floor, speedup])
    keep = [i for i in range(len(COLUMNS)) if any(c[i] != "-" for c in out)] if out else range(len(COLUMNS))
    return [COLUMNS[i] for i in keep], [[c[i] for i in keep] for c in out]


def markdown_table(rows: Sequence[MoeRow]) -> str:
    header, cells = table_rows(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    return "\n".join(lines) + "\n"


def bench_record(env: dict, rows: Sequence[MoeRow], command: str) -> dict:
    return {"command": command, "environment": env, "rows": [asdict(r) for r in rows]}
