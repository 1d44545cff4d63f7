"""Triton kernels: the glue of a routed mixture-of-experts block around its two grouped GEMMs.

- :func:`sort_by_expert`: the token copies of a top-k routing sorted by expert, stably, and each expert's cumulative
  row end, on the device (one program up to 1024 copies, a counting and a placing launch beyond; no host
  synchronisation, shapes fixed by the routing's size).
- :func:`combine`: each token's copies, weighted by the router and summed in a fixed order, back in token order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import _interpreting, rounded

__all__ = ["combine", "sort_by_expert"]

_CHUNK_ELEMENTS = 8192  # copies x experts a step of the sorting programs compares
_PER_PROGRAM = 256  # token copies each sorting program takes beyond the first's 1024
_ONE_PROGRAM = 1024  # copies one program sorts alone


@triton.jit
def _experts_of(ids_ptr, i, S, E):
    """Each copy's expert; -2 for copies routed outside [0, E), -1 past S (matching no expert)."""
    ids = tl.load(ids_ptr + i, mask=i < S, other=-1).to(tl.int32)
    return tl.where(i < S, tl.where((ids >= 0) & (ids < E), ids, -2), -1)


@triton.jit
def _count(ids_ptr, lo, hi, S, E, CHUNK: tl.constexpr, GROUPS: tl.constexpr):
    """The copies ``lo`` to ``hi`` by expert ([GROUPS]), and how many of them are routed outside [0, E)."""
    g = tl.arange(0, GROUPS)
    counts = tl.zeros((GROUPS,), dtype=tl.int32)
    outside = tl.full((), 0, tl.int32)
    for s0 in range(lo, hi, CHUNK):
        e = _experts_of(ids_ptr, s0 + tl.arange(0, CHUNK), S, E)
        counts += tl.sum((e[:, None] == g[None, :]).to(tl.int32), axis=0)
        outside += tl.sum((e == -2).to(tl.int32), axis=0)
    return counts, outside


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, S, E, P, PER, CHUNK: tl.constexpr, GROUPS: tl.constexpr):
    # counts [P, GROUPS] of each program's copies by expert, then [P] of those routed outside
    p = tl.program_id(0)
    counts, outside = _count(ids_ptr, p * PER, tl.minimum(p * PER + PER, S), S, E, CHUNK, GROUPS)
    tl.store(counts_ptr + p * GROUPS + tl.arange(0, GROUPS), counts)
    tl.store(counts_ptr + P * GROUPS + p, outside)


@triton.jit
def _place_kernel(
    ids_ptr, counts_ptr, off_ptr, src_ptr, S, E, PER, P, CHUNK: tl.constexpr, GROUPS: tl.constexpr, ONE: tl.constexpr
):
    p = tl.program_id(0)
    g = tl.arange(0, GROUPS)
    totals = tl.zeros((GROUPS,), dtype=tl.int32)
    earlier = tl.zeros((GROUPS,), dtype=tl.int32)  # copies of each expert in the programs before this one
    outside_earlier = tl.full((), 0, tl.int32)
    if ONE:  # one program: it counts every copy itself
        totals, _ = _count(ids_ptr, 0, S, S, E, CHUNK, GROUPS)
    else:  # the programs' counts, from _count_kernel
        for q in range(0, P):
            c = tl.load(counts_ptr + q * GROUPS + g)
            totals += c
            earlier += tl.where(q < p, c, 0)
            outside_earlier += tl.where(q < p, tl.load(counts_ptr + P * GROUPS + q), 0)
    ends = tl.cumsum(totals, axis=0)
    tl.store(off_ptr + g, ends, mask=(g < E) & (p == 0))
    taken = ends - totals + earlier  # each expert's next row for this program's copies
    outside_taken = tl.sum(totals, axis=0) + outside_earlier  # copies routed outside sort after every expert's
    for s0 in range(p * PER, tl.minimum(p * PER + PER, S), CHUNK):
        i = s0 + tl.arange(0, CHUNK)
        e = _experts_of(ids_ptr, i, S, E)
        hit = (e[:, None] == g[None, :]).to(tl.int32)
        before = tl.cumsum(hit, axis=0) - hit  # copies of the same expert earlier in this step
        out = (e == -2).to(tl.int32)
        row = tl.where(e == -2, outside_taken + tl.cumsum(out, axis=0) - out, tl.sum(hit * (before + taken), axis=1))
        tl.store(src_ptr + row, i, mask=i < S)
        taken += tl.sum(hit, axis=0)
        outside_taken += tl.sum(out, axis=0)


def sort_by_expert(topk_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_ids`` [T, k] (any integer dtype) -> (``offsets`` int32 [E], each expert's cumulative row end; ``src``
    int32 [T * k], the token copy ``t * k + j`` at each row sorted by expert, copies of one expert in token order).
    Copies routed outside ``[0, E)`` sort after the last expert's rows. One program up to :data:`_ONE_PROGRAM`
    copies; beyond, one counting and one placing program per :data:`_PER_PROGRAM` copies."""
    ids = topk_ids.reshape(-1)
    s = ids.numel()
    offsets = torch.empty(experts, dtype=torch.int32, device=ids.device)
    src = torch.empty(s, dtype=torch.int32, device=ids.device)
    groups = triton.next_power_of_2(experts)
    chunk = max(16, _CHUNK_ELEMENTS // groups)
    programs = 1 if s <= _ONE_PROGRAM else triton.cdiv(s, _PER_PROGRAM)
    per = triton.cdiv(max(s, 1), programs * chunk) * chunk
    meta = {"CHUNK": chunk, "GROUPS": groups, "num_warps": 8 if groups > 128 else 4}
    counts = offsets  # not read by one program
    if programs > 1:
        counts = torch.empty(programs * (groups + 1), dtype=torch.int32, device=ids.device)
        _count_kernel[(programs,)](ids, counts, s, experts, programs, per, **meta)
    _place_kernel[(programs,)](ids, counts, offsets, src, s, experts, per, programs, ONE=programs == 1, **meta)
    return offsets, src


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, TOPK: tl.constexpr, BH: tl.constexpr, INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = h < H
    out_ty = out_ptr.dtype.element_ty
    acc = tl.zeros((BH,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        y = tl.load(y_ptr + (t * TOPK + j) * H + h, mask=ok, other=0.0)
        w = tl.load(w_ptr + t * TOPK + j)
        acc += rounded(y.to(tl.float32) * w.to(tl.float32), out_ty, INTERPRET)
    tl.store(out_ptr + t * H + h, rounded(acc, out_ty, INTERPRET).to(out_ty), mask=ok)


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``y`` [T * k, H] (contiguous, token copies in token order), ``weights`` [T, k] in ``y``'s dtype -> [T, H]:
    ``sum_j round(y[t * k + j] * weights[t, j])`` in fp32 for j = 0..k-1 in turn, rounded to ``y``'s dtype."""
    tokens, k = weights.shape
    h = y.shape[1]
    out = torch.empty((tokens, h), dtype=y.dtype, device=y.device)
    if tokens and h:
        block = min(triton.next_power_of_2(h), 1024)
        grid = (tokens, triton.cdiv(h, block))
        _combine_kernel[grid](y, weights.contiguous(), out, h, TOPK=k, BH=block, INTERPRET=_interpreting())
    return out
