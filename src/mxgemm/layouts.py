"""Layouts the GEMM libraries read and write: swizzled E8M0 scale matrices, weights padded by rows, padded outputs.

A scale matrix ``S`` is ``[rows, cols]`` uint8, row-major (rows = M or N, cols = K/32). Swizzled forms are returned
flattened to 1-D uint8; padding bytes are zero.

``128x4`` (cuBLAS, CUTLASS, FlashInfer cutlass/cute-dsl): rows padded to a multiple of 128 and cols to a multiple of
4; each 128x4 tile is one 512-byte atom, atoms ordered row-tile major. Element ``S[m, k]`` lands at::

    offset = ((m // 128) * (cols_padded // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4

i.e. index order ``[m/128][k/4][m%32][(m%128)/32][k%4]``.

``8x4`` (TRT-LLM): rows padded to 8, cols to 4; 32-byte atoms, index order ``[m/8][k/4][m%8][k%4]``::

    offset = ((m // 8) * (cols_padded // 4) + k // 4) * 32 + (m % 8) * 4 + k % 4
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "finish_output",
    "from_8x4",
    "from_128x4",
    "grouped_128x4",
    "pad_rows",
    "padded_groups",
    "padded_size_8x4",
    "padded_size_128x4",
    "place_rows",
    "round_up",
    "to_8x4",
    "to_128x4",
]


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def pad_rows(qdata: torch.Tensor, scale: torch.Tensor, multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An MX weight (E4M3 [N, K]) and its scales ([N, K/32], uint8 or E8M0) with zero rows appended up to N a
    multiple of ``multiple`` (their products are zero): (E4M3, uint8)."""
    pad = round_up(qdata.shape[0], multiple) - qdata.shape[0]
    q = torch.nn.functional.pad(qdata.view(torch.uint8), (0, 0, 0, pad)).view(qdata.dtype)
    return q, torch.nn.functional.pad(scale.view(torch.uint8), (0, 0, 0, pad))


def finish_output(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """A library GEMM's (possibly padded, bf16) output -> [M, n] in ``x.dtype``, bias added, contiguous."""
    y = y[:, :n]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).contiguous()


def _check_scale(scale: torch.Tensor) -> None:
    if scale.dtype != torch.uint8 or scale.dim() != 2:
        raise ValueError(f"expected a 2-D uint8 scale matrix, got {scale.dtype} with shape {tuple(scale.shape)}")


def _pad(scale: torch.Tensor, row_mult: int, col_mult: int) -> torch.Tensor:
    rows, cols = scale.shape
    return F.pad(scale, (0, round_up(cols, col_mult) - cols, 0, round_up(rows, row_mult) - rows))


def _check_flat(flat: torch.Tensor, expected: int, name: str) -> None:
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() != expected:
        raise ValueError(
            f"{name} expects a flat uint8 tensor of {expected} bytes, got {flat.dtype} with shape {tuple(flat.shape)}"
        )


def padded_size_128x4(rows: int, cols: int) -> int:
    return round_up(rows, 128) * round_up(cols, 4)


def padded_size_8x4(rows: int, cols: int) -> int:
    return round_up(rows, 8) * round_up(cols, 4)


def to_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Swizzle ``[rows, cols]`` scales into the flat 128x4 layout (see module docstring)."""
    _check_scale(scale)
    p = _pad(scale, 128, 4)
    r, c = p.shape
    return p.reshape(r // 128, 4, 32, c // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1).contiguous()


def from_128x4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_128x4`: the ``[rows, cols]`` scales, padding dropped."""
    _check_flat(flat, padded_size_128x4(rows, cols), "from_128x4")
    r, c = round_up(rows, 128), round_up(cols, 4)
    return flat.reshape(r // 128, c // 4, 32, 4, 4).permute(0, 3, 2, 1, 4).reshape(r, c)[:rows, :cols].contiguous()


def padded_groups(offsets: torch.Tensor, rows: int, multiple: int = 128) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where the ``rows`` rows sorted by group (``offsets`` int32 ``[E]``, cumulative row ends, non-decreasing) go
    when each group's rows are padded to a multiple of ``multiple`` and the groups follow one another: ``dest``
    ``[rows]`` (int64, each row's padded place; ``padded_rows`` for rows past the last group's end), ``starts``
    ``[E + 1]`` (int64, each group's first padded row, then their end) and ``padded_rows`` (``rows`` rounded up to
    ``multiple``, plus ``multiple`` a group: it holds any routing, and depends on ``rows`` and E alone). On the
    device, without reading the offsets on the host."""
    groups = offsets.numel()
    padded_rows = round_up(rows, multiple) + multiple * groups
    ends = offsets.to(torch.int64).clamp(0, rows)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    padded = (ends - starts).clamp_min(0).add(multiple - 1).div(multiple, rounding_mode="floor").mul(multiple)
    first = torch.cat([padded.new_zeros(1), padded.cumsum(0)])
    i = torch.arange(rows, device=offsets.device)
    group = torch.searchsorted(ends, i, right=True)  # E past the last group's end
    g = group.clamp(max=groups - 1)
    dest = torch.where(group < groups, first[g] + i - starts[g], padded_rows)
    return dest, first, padded_rows


def place_rows(t: torch.Tensor, dest: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """``t``'s rows at their places ``dest`` of :func:`padded_groups` in ``[padded_rows, ...]`` zeros; the rows past
    the last group's end (place ``padded_rows``) land on a spare row that is left out."""
    return t.new_zeros(padded_rows + 1, *t.shape[1:]).index_copy_(0, dest, t)[:padded_rows]


def grouped_128x4(scale: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The scales ``[S, C]`` of rows sorted by group (``offsets`` int32 ``[E]``, cumulative row ends, non-decreasing)
    in the layout of PyTorch's MXFP8 grouped GEMM: each group's rows padded to a multiple of 128 and swizzled as
    :func:`to_128x4`, the groups one after another (:func:`padded_groups`), as a ``[Sp, round_up(C, 4)]`` matrix
    whose ``Sp`` depends on S and E alone; rows past the last group's end are left out. On the device, without reading
    the offsets on the host."""
    _check_scale(scale)
    rows, cols = scale.shape
    dest, _, padded_rows = padded_groups(offsets, rows)
    return to_128x4(place_rows(F.pad(scale, (0, round_up(cols, 4) - cols)), dest, padded_rows)).view(padded_rows, -1)


def to_8x4(scale: torch.Tensor) -> torch.Tensor:
    """Swizzle ``[rows, cols]`` scales into the flat 8x4 layout (see module docstring)."""
    _check_scale(scale)
    p = _pad(scale, 8, 4)
    r, c = p.shape
    return p.reshape(r // 8, 8, c // 4, 4).permute(0, 2, 1, 3).reshape(-1).contiguous()


def from_8x4(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`to_8x4`: the ``[rows, cols]`` scales, padding dropped."""
    _check_flat(flat, padded_size_8x4(rows, cols), "from_8x4")
    r, c = round_up(rows, 8), round_up(cols, 4)
    return flat.reshape(r // 8, c // 4, 8, 4).permute(0, 2, 1, 3).reshape(r, c)[:rows, :cols].contiguous()
