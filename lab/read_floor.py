"""What a kernel that only reads the active experts' weights takes at decode sizes, beside the grouped GEMM.

For each problem (a model's projection at a token count), under CUDA-graph replay of 8 routings as
``mxgemm bench --moe`` times them:

* ``read``: a Triton kernel that streams exactly the active experts' FP8 bytes (their ids made on the host
  beforehand) and XORs them into one word a program, the best of a sweep of chunk sizes, load widths and warps;
  what any kernel streaming those bytes pays, launch included;
* ``empty``: a kernel launch that does nothing;
* ``mxgemm``: ``grouped_linear`` as the bench calls it (quantization included), and the grouped Triton kernel with
  each decode config;
* ``splitk``: the grouped Triton kernel's decode path in lab variants: ``unroll`` blocks of 128 loaded apart in
  each iteration, ``split`` programs a tile over K (their fp32 partial sums added atomically into a zeroed fp32
  output, the zeroing timed with it, or with ``ws`` each stored in a workspace of its own and the reduction not
  made: what the splits' streaming alone costs), thin tiles of 16-32 weight rows; timing only, each checked against
  the kernel as it ships;
* with ``--one-token``, the reads again with the grouped kernel's prologue (each program finding its expert from
  ``offsets``), on the one-token problems.

Run on the device: PYTHONPATH=src python3 lab/read_floor.py [--one-token] --json $OUT/read-floor.json
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import triton
import triton.language as tl

import mxgemm
from mxgemm.bench_moe import FP8_BYTES_PER_PARAMETER, MOE_MODELS, copy_bandwidth, experts_with_bf16, routing_offsets
from mxgemm.kernels.grouped.fp8 import (
    GroupedConfig,
    _fp8_dot,
    _interpreting,
    grouped_block_linear,
    quantized_1x128,
    tile_of,
)
from mxgemm.timing import time_cuda

ROUTINGS = 8


@triton.jit
def _read(w_ptr, ids_ptr, out_ptr, expert_words, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    a = tl.program_id(0)
    c = tl.program_id(1)
    e = tl.load(ids_ptr + a).to(tl.int64)
    base = w_ptr + e * expert_words + c * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, CHUNK, BLOCK):
        acc ^= tl.load(base + i + tl.arange(0, BLOCK))
    tl.store(out_ptr + a * tl.num_programs(1) + c, tl.xor_sum(acc, axis=0))


@triton.jit
def _read_scan(
    w_ptr, off_ptr, out_ptr, expert_words, S, E, GROUPS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr
):
    """_read with the grouped kernel's prologue: each program finds its expert from ``offsets`` (16-row tiles)."""
    slot = tl.program_id(0)
    c = tl.program_id(1)
    grp, _, _ = tile_of(slot, off_ptr, S, E, GROUPS, 16)
    if grp < E:
        base = w_ptr + grp.to(tl.int64) * expert_words + c * CHUNK
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(0, CHUNK, BLOCK):
            acc ^= tl.load(base + i + tl.arange(0, BLOCK))
        tl.store(out_ptr + slot * tl.num_programs(1) + c, tl.xor_sum(acc, axis=0))


@triton.jit
def _empty(p):
    if tl.program_id(0) < 0:
        tl.store(p, 0)


@triton.jit
def _splitk(
    x_ptr,
    w_ptr,
    s_ptr,
    off_ptr,
    y_ptr,
    S,
    N,
    K,
    E,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    GROUPS: tl.constexpr,
    BN: tl.constexpr,
    BM: tl.constexpr,
    SPLIT: tl.constexpr,
    U: tl.constexpr,
    WS: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    part_k = tl.program_id(2)
    grp, first_row, end_row = tile_of(slot, off_ptr, S, E, GROUPS, BM)
    if grp < E:
        rm = first_row + tl.arange(0, BM)
        m_ok = rm < end_row
        rm64 = rm.to(tl.int64)
        rn = pid_n * BN + tl.arange(0, BN)
        n_ok = rn < N
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        rk = tl.arange(0, 128)
        w_base = w_ptr + grp.to(tl.int64) * stride_we + rn[:, None] * stride_wn
        s_base = s_ptr + grp.to(tl.int64) * stride_se + (rn // 128) * stride_sn
        per = K // SPLIT
        for k_step in range(part_k * per, part_k * per + per, 128 * U):
            for u in tl.static_range(U):  # U blocks of 128 an iteration, each loaded apart
                k0 = k_step + u * 128
                x = tl.load(x_ptr + rm64[:, None] * K + (k0 + rk)[None, :], mask=m_ok[:, None], other=0.0)
                xq, x_scale = quantized_1x128(x.to(tl.float32), INTERPRET)
                part = _fp8_dot(tl.load(w_base + (k0 + rk)[None, :], mask=n_ok[:, None], other=0), xq, INTERPRET)
                w_scale = tl.load(s_base + k0 // 128, mask=n_ok, other=0.0)
                acc += part * w_scale[:, None] * x_scale[None, :]
        y_ptrs = y_ptr + rm64[None, :] * N + rn[:, None]
        if SPLIT == 1:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])
        elif WS:  # each split's partial sums in a workspace of its own (the reduction not made)
            tl.store(y_ptrs + part_k.to(tl.int64) * S * N, acc, mask=m_ok[None, :] & n_ok[:, None])
        else:
            tl.atomic_add(y_ptrs, acc, mask=m_ok[None, :] & n_ok[:, None], sem="relaxed")


def splitk_call(x, qd, bs, offsets, n, bn, bm, split, warps, stages, unroll=1, ws=False):
    s, k = x.shape
    e = qd.shape[0]
    if split == 1:
        y = torch.empty((s, n), dtype=x.dtype, device=x.device)
    elif ws:
        y = torch.empty((split, s, n), dtype=torch.float32, device=x.device)
    else:
        y = torch.zeros((s, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(s, bm) + min(e + 1, s), triton.cdiv(n, bn), split)
    _splitk[grid](
        x,
        qd,
        bs,
        offsets,
        y,
        s,
        n,
        k,
        e,
        qd.stride(0),
        qd.stride(1),
        bs.stride(0),
        bs.stride(1),
        GROUPS=triton.next_power_of_2(e + 1),
        BN=bn,
        BM=bm,
        SPLIT=split,
        U=unroll,
        WS=ws,
        INTERPRET=_interpreting(),
        num_warps=warps,
        num_stages=stages,
    )
    return y


PROBLEMS = [
    ("qwen3-30b-a3b", "gate_up", [1, 4]),
    ("qwen3-30b-a3b", "down", [1, 4]),
    ("deepseek-v3", "down", [1]),
    ("mixtral-8x7b", "down", [1]),
    ("mixtral-8x7b", "gate_up", [1]),
]
READS = [(c, b, 8) for c in (2048, 4096) for b in (512, 2048)]
DECODE = [GroupedConfig(128, 16), GroupedConfig(64, 16)]
SPLITS = [(bn, 16, 1, 4, stages, unroll) for bn in (64, 128) for stages in (2, 3, 4) for unroll in (1, 2, 4)] + [
    (128, 16, 1, 8, 3, 2),
    (128, 16, 1, 8, 3, 4),
    (128, 16, 2, 4, 3, 1),
    (128, 16, 2, 4, 3, 2),
]
# --one-token: the K splits into a workspace of their own or added atomically, thin weight-row tiles (several
# programs an SM), and the reads again with the offsets scan
ONE_TOKEN_PROBLEMS = [("qwen3-30b-a3b", "gate_up", [1]), ("qwen3-30b-a3b", "down", [1]), ("mixtral-8x7b", "down", [1])]
ONE_TOKEN = [
    (bn, 16, split, warps, 3, 1, ws)
    for bn in (64, 128)
    for split in (2, 4, 8)
    for warps in (4, 8)
    for ws in (True, False)
] + [
    (bn, 16, 1, warps, stages, unroll) for bn in (16, 32) for warps in (2, 4) for stages in (3, 5) for unroll in (1, 2)
]


def read_times(words: torch.Tensor, ids: list[torch.Tensor]) -> dict[str, float]:
    """µs of :func:`_read` over each routing's active experts (``ids``, one tensor a routing) of ``words`` (int32
    ``[E, words an expert]``) under graph replay, by each of the ``READS`` that divide an expert's words."""
    times = {}
    for chunk, block, warps in READS:
        if words.shape[1] % chunk:
            continue
        grid_c = words.shape[1] // chunk
        sinks = [torch.empty(len(i) * grid_c, dtype=torch.int32, device=words.device) for i in ids]
        calls = [
            partial(_read[(len(i), grid_c)], words, i, o, words.shape[1], CHUNK=chunk, BLOCK=block, num_warps=warps)
            for i, o in zip(ids, sinks, strict=True)
        ]
        times[f"chunk={chunk * 4} B load={block * 4} B warps={warps}"] = time_cuda(calls, warmup_ms=20)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--one-token", action="store_true")
    args = parser.parse_args()
    problems, variants = (ONE_TOKEN_PROBLEMS, ONE_TOKEN) if args.one_token else (PROBLEMS, SPLITS)
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth()
    sink = torch.zeros(1, dtype=torch.int32, device=dev)
    empty_us = time_cuda([partial(_empty[(1,)], sink)] * ROUTINGS)
    print(f"copy {bandwidth / 1e12:.3f} TB/s (read plus written); empty launch {empty_us:.2f} us")
    out = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bandwidth, "empty_us": empty_us, "rows": []}
    table = []
    for model, proj, token_counts in problems:
        e, hidden, width, topk = MOE_MODELS[model]
        n, k = (2 * width, hidden) if proj == "gate_up" else (hidden, width)
        q, s, _ = experts_with_bf16(e, n, k, seed=1, device=dev)
        w = mxgemm.prepare_grouped_weight(q, s)
        del q, s
        qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
        words = qd.view(torch.int32).view(e, -1)
        for tokens in token_counts:
            rows = tokens * topk
            routed = [routing_offsets(tokens, e, topk, seed=r, device=dev) for r in range(ROUTINGS)]
            offs = [o for o, _ in routed]
            ids = [torch.nonzero(torch.diff(o, prepend=o.new_zeros(1))).flatten().int() for o in offs]
            active = sum(a for _, a in routed) / ROUTINGS
            floor = active * n * k * FP8_BYTES_PER_PARAMETER / bandwidth * 1e6
            xs = [torch.randn(rows, k, device=dev).bfloat16() for _ in offs]
            res = {"model": model, "proj": proj, "tokens": tokens, "active": active, "floor_us": floor}
            ref = grouped_block_linear(xs[0], qd, bs, offs[0], n, DECODE[0]).float()
            res["mxgemm"] = time_cuda(
                [partial(mxgemm.grouped_linear, x, w, o) for x, o in zip(xs, offs, strict=True)], warmup_ms=20
            )
            res["configs"] = {
                str(c): time_cuda(
                    [partial(grouped_block_linear, x, qd, bs, o, n, c) for x, o in zip(xs, offs, strict=True)],
                    warmup_ms=20,
                )
                for c in DECODE
            }
            res["reads"] = read_times(words, ids)
            res["splitk"] = {}
            for bn, bm, split, warps, stages, unroll, *ws in variants:
                ws = bool(ws and ws[0])
                if k % (128 * split * unroll):
                    continue
                try:
                    y = splitk_call(xs[0], qd, bs, offs[0], n, bn, bm, split, warps, stages, unroll, ws)
                except triton.runtime.errors.OutOfResources:
                    continue
                y = y.sum(0) if ws else y
                err = ((y[:rows].float() - ref).norm() / ref.norm()).item()
                calls = [
                    partial(splitk_call, x, qd, bs, o, n, bn, bm, split, warps, stages, unroll, ws)
                    for x, o in zip(xs, offs, strict=True)
                ]
                res["splitk"][
                    f"bn={bn} bm={bm} split={split} warps={warps} stages={stages} unroll={unroll} ws={ws} err={err:.1e}"
                ] = time_cuda(calls, warmup_ms=20)
            if args.one_token:  # the reads again, each program finding its expert from the offsets first
                slots = triton.cdiv(rows, 16) + min(e + 1, rows)
                for chunk, block, warps in READS:
                    if words.shape[1] % chunk:
                        continue
                    grid_c = words.shape[1] // chunk
                    sinks = [torch.empty(slots * grid_c, dtype=torch.int32, device=dev) for _ in offs]
                    calls = [
                        partial(
                            _read_scan[(slots, grid_c)],
                            words,
                            o,
                            z,
                            words.shape[1],
                            rows,
                            e,
                            GROUPS=triton.next_power_of_2(e + 1),
                            CHUNK=chunk,
                            BLOCK=block,
                            num_warps=warps,
                        )
                        for o, z in zip(offs, sinks, strict=True)
                    ]
                    res["reads"][f"scan chunk={chunk * 4} B load={block * 4} B warps={warps}"] = time_cuda(
                        calls, warmup_ms=20
                    )
            read_best = min(res["reads"], key=res["reads"].get)
            cfg_best = min(res["configs"], key=res["configs"].get)
            split_best = min(res["splitk"], key=res["splitk"].get) if res["splitk"] else None
            print(f"== {model} {proj} T={tokens} active {active:.1f} floor {floor:.1f} us")
            for name in ("reads", "configs", "splitk"):
                for key, us in sorted(res[name].items(), key=lambda kv: kv[1])[: 12 if name == "reads" else 6]:
                    print(f"   {name:8s} {us:8.1f}  {key}")
            table.append(
                (
                    model,
                    proj,
                    tokens,
                    floor,
                    res["reads"][read_best],
                    res["mxgemm"],
                    res["configs"][cfg_best],
                    res["splitk"][split_best] if split_best else float("nan"),
                )
            )
            out["rows"].append(res)
        del w, qd, bs, words
        torch.cuda.empty_cache()
    print(f"\nempty launch {empty_us:.2f} us a call under graph replay")
    print(f"{'problem':32s} {'floor':>7s} {'read':>7s} {'mxgemm':>7s} {'config':>7s} {'splitk':>7s}  mxgemm/read")
    for model, proj, tokens, floor, read, ours, cfg, split in table:
        print(
            f"{model + ' ' + proj + ' T=' + str(tokens):32s} {floor:7.1f} {read:7.1f} {ours:7.1f} {cfg:7.1f} "
            f"{split:7.1f}  {ours / read:.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
