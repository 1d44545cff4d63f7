"""The grouped wgmma kernel's CPU side: the row quantizer it reads (gathered token rows, the gated product) bit-exact
to the 1x128 reference under the interpreter, its configs and one-line refusals, which kernel a grouped call takes,
and the CUDA source compiling for sm_90a where nvcc exists."""

import functools
import os

import pytest
import torch
from helpers import random_act

from mxgemm.block128 import quantize_1x128
from mxgemm.kernels import nvcc
from mxgemm.kernels.grouped import wgmma
from mxgemm.kernels.grouped.fp8 import token_tile_slots
from mxgemm.kernels.grouped.wgmma import WgmmaConfig, grouped_wgmma

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1")


def _check(q, s, x):
    rows, k = x.shape
    ref_q, ref_s = quantize_1x128(x)
    kp = -(-k // 128) * 128
    assert q.shape == (-(-rows // 4) * 4, kp) and s.shape == (kp // 128, q.shape[0])
    assert torch.equal(q[:rows, :k], ref_q.view(torch.uint8)[:rows, :k])
    assert torch.equal(s[:, :rows], ref_s[:rows].t())
    assert not q[rows:].any() and not q[:, k:].any()


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gathered_rows_are_the_reference_quantization_of_the_gathered_tokens(dtype):
    from mxgemm.kernels.grouped.quant import quantize_rows

    x = random_act(9, 200, dtype=dtype, seed=1)
    x[3, :128] = 0  # an all-zero block: the amax floor
    src = torch.tensor([5, 0, 17, 3, 3, 26, 12, 8, 1, 22, 9], dtype=torch.int32)  # copies t * 3 + j
    q, s = quantize_rows(x, src, 3)
    _check(q, s, x[src.long() // 3])


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_rows_are_the_reference_quantization_of_pytorchs_product(dtype):
    from mxgemm.kernels.grouped.quant import quantize_rows

    h = random_act(6, 2 * 160, dtype=dtype, seed=2) * 4
    q, s = quantize_rows(h, gated=True)
    gate, up = h.chunk(2, dim=-1)
    _check(q, s, torch.nn.functional.silu(gate) * up)
    q, s = quantize_rows(h[:, :160])  # plain rows, a strided view
    _check(q, s, h[:, :160])


@interpreted
def test_the_rows_launch_shape_keeps_the_bits():
    """Other rows a program and warps (``block_rows``, ``warps``: what lab/rows_quant.py times) give the same bits,
    gathered and gated, rows past a program's end included."""
    from mxgemm.kernels.grouped.quant import quantize_rows

    x, h = random_act(9, 200, seed=3), random_act(37, 2 * 160, seed=4)
    src = torch.randperm(27).to(torch.int32)
    for args, kw in (((x, src, 3), {}), ((h,), {"gated": True})):
        ref = quantize_rows(*args, **kw)
        for rows, warps in ((32, 4), (64, 8)):
            q, s = quantize_rows(*args, **kw, block_rows=rows, warps=warps)
            assert torch.equal(q, ref[0]) and torch.equal(s, ref[1]), (rows, warps)


def test_configs_and_one_line_refusals():
    assert WgmmaConfig().valid() and WgmmaConfig(64, 64, 2).valid() and WgmmaConfig(128, 64, 6).valid()
    w, bs, off = torch.zeros(2, 8, 128, dtype=torch.uint8), torch.zeros(2, 1, 1), torch.zeros(2, dtype=torch.int32)
    xq, xs = torch.zeros(4, 128, dtype=torch.uint8), torch.zeros(1, 4)
    for bad in (WgmmaConfig(tn=32), WgmmaConfig(wn=256), WgmmaConfig(stages=3)):
        assert not bad.valid()
        with pytest.raises(ValueError, match="cannot run"):
            grouped_wgmma(xq, xs, 4, w, bs, off, 8, torch.bfloat16, bad)
    with pytest.raises(ValueError, match="quantize_rows' layout"):  # activations not padded to 128 columns
        grouped_wgmma(torch.zeros(4, 96, dtype=torch.uint8), xs, 4, w, bs, off, 8, torch.bfloat16, WgmmaConfig())
    with pytest.raises(ValueError, match="int32 offsets"):
        grouped_wgmma(xq, xs, 4, w, bs, off.long(), 8, torch.bfloat16, WgmmaConfig())


def test_which_kernel_a_grouped_call_takes(monkeypatch):
    """The GEMV where a call has at most 2 rows or one for grouped_gemv_experts_per_row experts, on any device and at
    any K (one token of a top-k routing); else on SM90 with the library built: the wgmma kernel from grouped_wgmma_from
    rows per expert of an even routing (at any rows from K = grouped_wgmma_deep_k), 64-row tiles below 128 rows per
    expert, on its persistent grid up to K = grouped_persistent_max_k, and 128-row ones on its persistent grid from
    there; the Triton kernel below that, on other GPUs, on a CPU, and where the library does not build. The tactics
    offered start with that default; the wgmma kernel's only where it runs. The routed block's down takes the GEMV
    where gate/up's default does."""
    from types import SimpleNamespace

    from mxgemm import thresholds
    from mxgemm.backends import get_backend, triton_w8a16
    from mxgemm.backends.triton_w8a16 import Path, _default_grouped, _experts_tactics
    from mxgemm.thresholds import SM90

    WGMMA_FROM, WGMMA_DEEP_K = SM90.grouped_wgmma_from, SM90.grouped_wgmma_deep_k
    PERSISTENT_MAX_K = SM90.grouped_persistent_max_k
    from mxgemm.kernels.grouped.fp8 import GroupedConfig
    from mxgemm.kernels.grouped.gemv import GemvConfig
    from mxgemm.kernels.grouped.wgmma import Availability

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)

    def per8(per_expert, device, k):  # per_expert rows on each of 8 experts
        return _default_grouped(8 * per_expert, 8, device, k)

    gemv, triton = (triton_w8a16.Tactic(Path.GROUPED, c) for c in (GemvConfig(16, 4), GroupedConfig(128, 16)))
    every = SM90.grouped_gemv_experts_per_row
    assert _default_grouped(2, 8, cpu, 2048) == gemv and _default_grouped(3, 8, cpu, 2048) == triton
    assert _default_grouped(128 // every, 128, cpu, 768) == gemv  # one token of Qwen3-30B-A3B's top 8 of 128
    assert _default_grouped(128 // every + 1, 128, cpu, 768) == triton
    qwen3 = SimpleNamespace(experts=128, device=cpu, in_features=2048)
    assert _experts_tactics(8, qwen3, (None, None)) == (gemv, gemv)
    assert _experts_tactics(64, qwen3, (None, None)) == (triton, None)
    tuned = triton_w8a16.Tactic(Path.GROUPED, GroupedConfig(64, 16))
    assert _experts_tactics(8, qwen3, (tuned, None)) == (tuned, gemv)
    assert get_backend("triton").grouped_tactics(1, qwen3, active=8)[0] == gemv
    assert get_backend("triton").grouped_tactics(1, qwen3)[0] == triton  # one row on each of 128
    assert per8(4096, cpu, 2048) == triton_w8a16.Tactic(Path.GROUPED, GroupedConfig(256, 64, 8, 3, True))
    assert not wgmma.wgmma_status((8, 9)) and "SM90" in wgmma.wgmma_status((8, 9)).reason
    weight = SimpleNamespace(experts=8, device=cpu, in_features=2048)
    assert {t.path for t in get_backend("triton").grouped_tactics(256, weight)} == {Path.GROUPED}

    capability, built = [(9, 0)], [Availability(True, "built")]
    monkeypatch.setattr(triton_w8a16.torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(thresholds, "_sm", functools.cache(thresholds._sm.__wrapped__))  # this test's answers only
    monkeypatch.setattr(wgmma, "wgmma_status", lambda cap: built[0])
    assert per8(WGMMA_FROM - 1, gpu, 2048).path == Path.GROUPED
    assert per8(WGMMA_FROM, gpu, 2048).config == WgmmaConfig(tn=64, wn=128, stages=4, persistent=True)
    assert per8(127, gpu, 2048).config == WgmmaConfig(tn=64, wn=128, stages=4, persistent=True)
    assert per8(128, gpu, PERSISTENT_MAX_K).config == WgmmaConfig(128, 128, 4, persistent=True)
    assert per8(128, gpu, PERSISTENT_MAX_K + 128).config == WgmmaConfig(128, 128, 4, persistent=True)
    assert per8(127, gpu, PERSISTENT_MAX_K + 128).config == WgmmaConfig(tn=64, wn=128, stages=4)
    assert per8(1, gpu, WGMMA_DEEP_K).config == WgmmaConfig(tn=64, wn=128, stages=4)
    assert per8(1, gpu, WGMMA_DEEP_K - 128).path == Path.GROUPED
    assert per8(1, cpu, WGMMA_DEEP_K).path == Path.GROUPED
    tactics = get_backend("triton").grouped_tactics(128, SimpleNamespace(experts=8, device=gpu, in_features=2048))
    assert tactics[0] == per8(128, gpu, 2048) and len(set(tactics)) == len(tactics)
    assert sum(t.path == Path.WGMMA for t in tactics) == 16 and sum(t.path == Path.GROUPED for t in tactics) == 3
    assert sum(t.path == Path.WGMMA and t.config.persistent for t in tactics) == 8
    assert _default_grouped(2, 8, gpu, WGMMA_DEEP_K) == gemv  # Mixtral's one token: at any K
    capability[0] = (10, 0)
    assert per8(128, gpu, 2048).path == Path.GROUPED
    capability[0], built[0] = (9, 0), Availability(False, "nvcc was not found")
    assert per8(128, gpu, 2048).path == Path.GROUPED


def _moe_workspace(t: int, k: int, e: int, h: int, i: int, elem: int) -> int:
    """mxgemm_moe_workspace's layout: the sort's counts (E + 1 per block of 1024 copies), offsets and sources; gate/up's
    quantized rows (rows rounded up to 4, H to 128) and their scales; its output; down's quantized rows and scales; its
    output."""
    rows = t * k
    sp, kp1, kp2 = -(-rows // 4) * 4, -(-h // 128) * 128, -(-i // 128) * 128
    parts = [-(-rows // 1024) * (e + 1) * 4, e * 4, rows * 4, sp * kp1, kp1 // 128 * sp * 4, rows * 2 * i * elem]
    parts += [sp * kp2, kp2 // 128 * sp * 4, rows * h * elem]
    return sum(-(-part // 256) * 256 for part in parts)


@pytest.mark.skipif(nvcc.find_nvcc() is None, reason="no nvcc on this machine")
def test_the_kernel_compiles_for_sm90_and_loads(monkeypatch, tmp_path):
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    wgmma.library.cache_clear()
    try:
        lib = wgmma.library((9, 0))
        assert hasattr(lib, "mxgemm_grouped_fp8") and hasattr(lib, "mxgemm_moe_experts")
        assert len(list((tmp_path / "kernels").glob("grouped_fp8-sm90a-*.so"))) == 1
        # the routed block's scratch (a host function): its parts, each 256-byte aligned, for Qwen3's, DeepSeek-V3's
        # and Mixtral's shapes at one and 4096 tokens, bf16 and fp32-sized activations
        for t, k, e, h, i in [(1, 8, 128, 2048, 768), (4096, 8, 256, 7168, 2048), (4096, 2, 8, 4096, 14336)]:
            for elem in (2, 4):
                assert lib.mxgemm_moe_workspace(t, k, e, h, i, elem) == _moe_workspace(t, k, e, h, i, elem)
        # the routed block's token-tile slots (a host function) are the Python launches' for every tile height
        for rows, e in [(1, 8), (7, 128), (64, 128), (4096 * 8, 256), (100_000, 16), (3, 1000)]:
            for tn in (16, 64, 128, 256):
                assert lib.mxgemm_token_tile_slots(rows, e, tn) == token_tile_slots(rows, e, tn)
    finally:
        wgmma.library.cache_clear()
