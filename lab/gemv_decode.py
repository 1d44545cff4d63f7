"""A grouped GEMV on CUDA cores for decode, beside the grouped Triton kernel and the read floor.

At one token the grouped kernel runs one CTA of 4 warps an SM and reads at 40% of DRAM's bandwidth
(``lab/results/decode-ncu-h100.txt``), while a kernel that only reads the active experts' bytes (``read``) runs 50
warps an SM. This variant has the read's shape: each program takes one sorted row (``tile_of`` with 1-row tiles) and
``BN`` weight rows, streams ``BK`` bytes of each a step (``BK / 128`` scale blocks at once), converts them to fp32
and sums ``w * q(x)`` on CUDA cores; no tensor core, no shared-memory pipeline, so many programs fit an SM. The
row's 1x128 quantization is made in the program, as the grouped kernel makes it; sums are fp32 (closer to the exact
product than the FP8 tensor cores'), so outputs differ from the grouped kernel's in the last bits.

Forms: plain (``grouped_linear``'s), gated (the block's gate/up: rows gathered from the tokens, ``BN`` gate and
``BN`` up rows a program, ``silu(gate) * up``) and scattered (the block's down).

For each problem, under CUDA-graph replay of 8 routings as ``mxgemm bench --moe`` times them: the best read of
``lab/read_floor.py``'s sweep, the grouped kernel (its default decode config and 64 weight rows), and every GEMV
variant, each checked against the grouped kernel (relative error) before it is timed.

Run on the device: PYTHONPATH=src python3 lab/gemv_decode.py --json $OUT/gemv-decode.json
On CPU (interpreter, small shapes, no timing): TRITON_INTERPRET=1 PYTHONPATH=src python3 lab/gemv_decode.py --check
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import triton
import triton.language as tl
from read_floor import READS, _read

import mxgemm
from mxgemm.bench_moe import FP8_BYTES_PER_PARAMETER, MOE_MODELS, copy_bandwidth, random_experts, top_k_routing
from mxgemm.kernels.grouped.fp8 import (
    GroupedConfig,
    _interpreting,
    _silu_times,
    grouped_block_linear,
    grouped_down,
    grouped_gate_up,
    quantized_1x128,
    rounded,
    tile_of,
)
from mxgemm.kernels.grouped.routing import sort_by_expert
from mxgemm.timing import time_cuda

ROUTINGS = 8


@triton.jit
def _w_times_x(w_ptrs, w_ok, xq, INTERPRET: tl.constexpr):
    """[BN, KB, 128] E4M3 bytes times the quantized row [KB, 128], summed over each 128: [BN, KB] in fp32."""
    w = tl.load(w_ptrs, mask=w_ok, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.sum(w * xq[None, :, :], axis=2)


@triton.jit
def _gemv(
    x_ptr,
    w_ptr,
    s_ptr,
    off_ptr,
    y_ptr,
    src_ptr,
    S,
    N,
    K,
    E,
    TOPK,
    stride_xs,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ys,
    GROUPS: tl.constexpr,
    BN: tl.constexpr,
    KB: tl.constexpr,
    GATHER: tl.constexpr,
    GATED: tl.constexpr,
    SCATTER: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    grp, row, _ = tile_of(slot, off_ptr, S, E, GROUPS, 1)
    if grp <= E:
        row64 = row.to(tl.int64)
        xm = row64
        ym = row64
        if GATHER or SCATTER:
            src = tl.load(src_ptr + row64).to(tl.int64)
            if GATHER:
                xm = src // TOPK
            if SCATTER:
                ym = src
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        acc = tl.zeros((BN,), dtype=tl.float32)
        acc_up = tl.zeros((BN,), dtype=tl.float32)
        if grp < E:
            kb = tl.arange(0, KB)
            rk = tl.arange(0, 128)
            w_base = w_ptr + grp.to(tl.int64) * stride_we + rn[:, None, None] * stride_wn
            s_base = s_ptr + grp.to(tl.int64) * stride_se + (rn // 128)[:, None] * stride_sn
            s_up = s_ptr + grp.to(tl.int64) * stride_se + ((rn + N) // 128)[:, None] * stride_sn
            for k0 in range(0, K, 128 * KB):
                kk = k0 + kb[:, None] * 128 + rk[None, :]  # [KB, 128]
                k_ok = kk < K
                x = tl.load(x_ptr + xm * stride_xs + kk, mask=k_ok, other=0.0).to(tl.float32)
                xq, x_scale = quantized_1x128(x, INTERPRET)  # [KB, 128], [KB]
                xq = xq.to(tl.float32)
                w_ptrs = w_base + kk[None, :, :]
                w_ok = n_ok[:, None, None] & k_ok[None, :, :]
                blocks = k0 // 128 + kb
                b_ok = n_ok[:, None] & (blocks * 128 < K)[None, :]
                w_scale = tl.load(s_base + blocks[None, :], mask=b_ok, other=0.0)
                acc += tl.sum(_w_times_x(w_ptrs, w_ok, xq, INTERPRET) * w_scale * x_scale[None, :], axis=1)
                if GATED:
                    up_scale = tl.load(s_up + blocks[None, :], mask=b_ok, other=0.0)
                    part = _w_times_x(w_ptrs + N * stride_wn, w_ok, xq, INTERPRET)
                    acc_up += tl.sum(part * up_scale * x_scale[None, :], axis=1)
        out_ty = y_ptr.dtype.element_ty
        if GATED:
            acc = _silu_times(rounded(acc, out_ty, INTERPRET), rounded(acc_up, out_ty, INTERPRET), out_ty, INTERPRET)
        tl.store(y_ptr + ym * stride_ys + rn, rounded(acc, out_ty, INTERPRET).to(out_ty), mask=n_ok)


def gemv(
    x, w_bytes, block_scale, offsets, n, bn, kb, warps, *, rows=None, src=None, topk=1, gated=False, scatter=False
):
    """The GEMV over ``rows`` sorted rows (``x.shape[0]`` unless ``src`` gathers): ``n`` outputs (gated: ``n`` gate
    and ``n`` up rows, ``silu(gate) * up``)."""
    rows = x.shape[0] if rows is None else rows
    k = x.shape[1]
    e = w_bytes.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    grid = (rows + min(e + 1, rows), triton.cdiv(n, bn))
    _gemv[grid](
        x,
        w_bytes,
        block_scale,
        offsets,
        y,
        offsets if src is None else src,
        rows,
        n,
        k,
        e,
        topk,
        x.stride(0),
        w_bytes.stride(0),
        w_bytes.stride(1),
        block_scale.stride(0),
        block_scale.stride(1),
        y.stride(0),
        GROUPS=triton.next_power_of_2(e + 1),
        BN=bn,
        KB=kb,
        GATHER=src is not None and not scatter,
        GATED=gated,
        SCATTER=scatter,
        INTERPRET=_interpreting(),
        num_warps=warps,
    )
    return y


def _calls(form, xs, tokens_xs, qd, bs, routed, n, topk, variant):
    """One call per routing of ``form`` (plain, gated, scatter) on the grouped kernel (``variant`` a GroupedConfig)
    or the GEMV (``variant`` (bn, kb, warps))."""
    calls = []
    for x, t, (offs, src) in zip(xs, tokens_xs, routed, strict=True):
        rows = src.shape[0]
        if isinstance(variant, GroupedConfig):
            if form == "plain":
                calls.append(partial(grouped_block_linear, x, qd, bs, offs, n, variant))
            elif form == "gated":
                calls.append(partial(grouped_gate_up, t, qd, bs, offs, src, topk, variant))
            else:
                calls.append(partial(grouped_down, x, qd, bs, offs, src, n, variant))
        else:
            bn, kb, warps = variant
            if form == "plain":
                calls.append(partial(gemv, x, qd, bs, offs, n, bn, kb, warps))
            elif form == "gated":
                calls.append(
                    partial(gemv, t, qd, bs, offs, n // 2, bn, kb, warps, rows=rows, src=src, topk=topk, gated=True)
                )
            else:
                calls.append(partial(gemv, x, qd, bs, offs, n, bn, kb, warps, src=src, scatter=True))
    return calls


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def check() -> None:
    """Interpreter check on small shapes: every form, uneven routings (empty experts, one expert, rows past the
    last), against the grouped kernel."""
    torch.manual_seed(0)
    e, k, n, topk = 4, 384, 160, 2
    qd = torch.randint(0, 256, (e, 2 * n, k), dtype=torch.uint8)
    qd[(qd & 0x7F) == 0x7F] = 0  # no NaN bytes
    bs = torch.exp2(torch.randint(-8, 0, (e, triton.cdiv(2 * n, 128), triton.cdiv(k, 128))).float())
    for ids in (torch.tensor([[0, 2], [2, 3], [0, 3]]), torch.tensor([[1, 1], [1, 1]]), torch.tensor([[3, 5]])):
        tokens = ids.shape[0]
        offs, src = sort_by_expert(ids, e)
        t = torch.randn(tokens, k).bfloat16()
        xr = torch.randn(ids.numel(), k).bfloat16()
        for form in ("plain", "gated", "scatter"):
            ref = _calls(
                form, [xr], [t], qd, bs, [(offs, src)], 2 * n if form == "gated" else n, topk, GroupedConfig(64, 16)
            )[0]()
            for variant in ((16, 1, 4), (32, 2, 4), (64, 4, 8)):
                y = _calls(form, [xr], [t], qd, bs, [(offs, src)], 2 * n if form == "gated" else n, topk, variant)[0]()
                err = _rel(y, ref)
                print(f"{form:8s} ids={ids.tolist()} {variant}: rel err {err:.1e}")
                assert err < 1e-2, (form, variant, err)
    print("check: every form and variant within 1e-2 of the grouped kernel")


PROBLEMS = [
    ("qwen3-30b-a3b", "gate_up", [1, 4]),
    ("qwen3-30b-a3b", "down", [1, 4]),
    ("deepseek-v3", "down", [1]),
    ("mixtral-8x7b", "down", [1]),
    ("mixtral-8x7b", "gate_up", [1]),
]
GEMVS = [(bn, kb, warps) for bn in (16, 32, 64) for kb in (1, 2, 4) for warps in (4, 8) if bn * kb <= 128]
DECODE = [GroupedConfig(128, 16), GroupedConfig(64, 16)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        check()
        return
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.3f} TB/s (read plus written)")
    out = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bandwidth, "rows": []}
    table = []
    for model, proj, token_counts in PROBLEMS:
        e, hidden, width, topk = MOE_MODELS[model]
        n, k = (2 * width, hidden) if proj == "gate_up" else (hidden, width)
        w = mxgemm.prepare_grouped_weight(*random_experts(e, n, k, seed=1, device=dev))
        qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
        words = qd.view(torch.int32).view(e, -1)
        for tokens in token_counts:
            picks = [top_k_routing(tokens, e, topk, seed=r, device=dev)[0] for r in range(ROUTINGS)]
            routed = [sort_by_expert(i, e) for i in picks]
            ids = [torch.unique(i.flatten()).int() for i in picks]
            active = sum(len(i) for i in ids) / ROUTINGS
            floor = active * n * k * FP8_BYTES_PER_PARAMETER / bandwidth * 1e6
            rows = tokens * topk
            xs = [torch.randn(rows, k, device=dev).bfloat16() for _ in picks]
            ts = [torch.randn(tokens, k, device=dev).bfloat16() for _ in picks]
            reads = {}
            for chunk, block, warps in READS:
                if words.shape[1] % chunk:
                    continue
                grid_c = words.shape[1] // chunk
                sinks = [torch.empty(len(i) * grid_c, dtype=torch.int32, device=dev) for i in ids]
                reads[(chunk, block, warps)] = time_cuda(
                    [
                        partial(
                            _read[(len(i), grid_c)],
                            words,
                            i,
                            s,
                            words.shape[1],
                            CHUNK=chunk,
                            BLOCK=block,
                            num_warps=warps,
                        )
                        for i, s in zip(ids, sinks, strict=True)
                    ],
                    warmup_ms=20,
                )
            read = min(reads.values())
            forms = ("plain", "gated") if proj == "gate_up" else ("plain", "scatter")
            for form in forms:
                res = {
                    "model": model,
                    "proj": proj,
                    "form": form,
                    "tokens": tokens,
                    "active": active,
                    "floor_us": floor,
                    "read_us": read,
                    "grouped": {},
                    "gemv": {},
                }
                ref = _calls(form, xs, ts, qd, bs, routed, n, topk, DECODE[0])[0]()
                for c in DECODE:
                    res["grouped"][str(c)] = time_cuda(_calls(form, xs, ts, qd, bs, routed, n, topk, c), warmup_ms=20)
                for v in GEMVS:
                    calls = _calls(form, xs, ts, qd, bs, routed, n, topk, v)
                    try:
                        err = _rel(calls[0](), ref)
                    except triton.runtime.errors.OutOfResources:
                        continue
                    if err > 1e-2:
                        print(f"   {form} {v}: rel err {err:.1e} against the grouped kernel; not timed")
                        continue
                    res["gemv"][f"bn={v[0]} kb={v[1]} warps={v[2]}"] = time_cuda(calls, warmup_ms=20)
                g_best = min(res["grouped"], key=res["grouped"].get)
                v_best = min(res["gemv"], key=res["gemv"].get) if res["gemv"] else None
                print(f"== {model} {proj} {form} T={tokens} active {active:.1f} floor {floor:.1f} read {read:.1f} us")
                for name in ("grouped", "gemv"):
                    for key, us in sorted(res[name].items(), key=lambda kv: kv[1])[:6]:
                        print(f"   {name:8s} {us:8.1f}  {key}")
                table.append(
                    (
                        f"{model} {proj} {form} T={tokens}",
                        floor,
                        read,
                        res["grouped"][g_best],
                        res["gemv"][v_best] if v_best else float("nan"),
                        v_best,
                    )
                )
                out["rows"].append(res)
        del w, qd, bs, words
        torch.cuda.empty_cache()
    print(f"\n{'problem':40s} {'floor':>7s} {'read':>7s} {'grouped':>8s} {'gemv':>7s}  gemv/floor  best gemv")
    for name, floor, read, grouped, best, v_best in table:
        print(f"{name:40s} {floor:7.1f} {read:7.1f} {grouped:8.1f} {best:7.1f}  {best / floor:10.2f}  {v_best}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
