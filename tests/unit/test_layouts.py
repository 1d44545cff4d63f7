"""Scale layouts: the documented index formulas, round trips and padding (property tests)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxgemm import layouts


def _offset_128x4(m, k, cols):
    cp = layouts.round_up(cols, 4)
    return ((m // 128) * (cp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4


def _offset_8x4(m, k, cols):
    cp = layouts.round_up(cols, 4)
    return ((m // 8) * (cp // 4) + k // 4) * 32 + (m % 8) * 4 + k % 4


CASES = [
    (layouts.to_128x4, layouts.from_128x4, _offset_128x4, layouts.padded_size_128x4),
    (layouts.to_8x4, layouts.from_8x4, _offset_8x4, layouts.padded_size_8x4),
]


def _scales(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 255, (rows, cols), generator=g, dtype=torch.uint8)  # never 0: padding is 0


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 20), seed=st.integers(0, 1000), case=st.sampled_from(CASES))
def test_swizzle_matches_formula_and_round_trips(rows, cols, seed, case):
    to, back, offset, size = case
    s = _scales(rows, cols, seed)
    flat = to(s)
    assert flat.dtype == torch.uint8 and flat.dim() == 1 and flat.numel() == size(rows, cols)
    m = torch.arange(rows).repeat_interleave(cols)
    k = torch.arange(cols).repeat(rows)
    idx = torch.tensor([offset(int(a), int(b), cols) for a, b in zip(m, k, strict=True)])
    assert torch.equal(flat[idx], s.reshape(-1))
    # every other byte is padding, and zero
    pad = torch.ones(flat.numel(), dtype=torch.bool)
    pad[idx] = False
    assert int(flat[pad].sum()) == 0
    assert torch.equal(back(flat, rows, cols), s)


def test_known_atom():
    s = torch.arange(128 * 4, dtype=torch.int32).reshape(128, 4).to(torch.uint8)
    flat = layouts.to_128x4(s)
    # byte 16 is row 1, col 0; byte 4 is row 32, col 0
    assert flat[16].item() == s[1, 0].item() and flat[4].item() == s[32, 0].item()
    assert flat[1].item() == s[0, 1].item()


def test_errors():
    with pytest.raises(ValueError, match="2-D uint8"):
        layouts.to_128x4(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="2-D uint8"):
        layouts.to_8x4(torch.zeros(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="512 bytes"):
        layouts.from_128x4(torch.zeros(100, dtype=torch.uint8), 4, 4)
    with pytest.raises(ValueError, match="32 bytes"):
        layouts.from_8x4(torch.zeros(31, dtype=torch.uint8), 3, 2)
