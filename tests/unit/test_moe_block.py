"""The routed block of a mixture of experts in four Triton launches, under the interpreter: the copies sorted by expert
as a stable argsort sorts them (one program and several), the weighted sum in its fixed order, and the whole block
bit for bit the composition of its steps (``GroupedWeights.run_experts``'s default) on the same grouped kernel, for
uneven routings, empty experts, copies routed outside ``[0, E)`` and every config shape."""

import dataclasses
import os

import pytest
import torch
from helpers import random_act, random_mx_weight

import mxgemm
from mxgemm.backends import get_backend
from mxgemm.backends.capabilities import GroupedWeights

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1")

E, H, I = 4, 160, 96  # noqa: E741 (the expert width, as the papers name it); H: a 128-deep step and a 32-deep one


def _experts(e=E):
    out = []
    for n, k, seed in ((2 * I, H, 0), (H, I, 100)):
        pairs = [random_mx_weight(n, k, seed=seed + i) for i in range(e)]
        q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        out.append(mxgemm.prepare_grouped_weight(q, s, backend="triton"))
    return out


def _argsort_route(ids, experts):
    groups = torch.where((ids >= 0) & (ids < experts), ids, experts).reshape(-1)
    ends = torch.bincount(groups, minlength=experts + 1).cumsum(0)[:experts].to(torch.int32)
    return ends, torch.argsort(groups, stable=True).to(torch.int32)


@pytest.mark.parametrize(
    "tokens, k, experts",
    [(1, 1, 4), (7, 2, 4), (300, 8, 128), (2000, 8, 16), (5, 2, 300), (0, 2, 4)],
    ids=["one", "few", "qwen3-decode", "several-programs", "many-experts", "none"],
)
def test_sort_by_expert_is_a_stable_argsort(tokens, k, experts):
    from mxgemm.kernels.grouped.routing import sort_by_expert

    g = torch.Generator().manual_seed(tokens + experts)
    ids = torch.randint(-1, experts + 1, (tokens, k), generator=g)  # some routed outside [0, E)
    for dtype in (torch.int64, torch.int32):
        offsets, src = sort_by_expert(ids.to(dtype), experts)
        ends, order = _argsort_route(ids, experts)
        assert torch.equal(offsets, ends) and torch.equal(src, order), dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_sums_each_tokens_rounded_copies_in_topk_order(dtype):
    from mxgemm.kernels.grouped.routing import combine

    y = random_act(5 * 8, 1100, dtype=dtype)  # H past one program's block
    w = torch.rand(5, 8, generator=torch.Generator().manual_seed(3)).softmax(-1).to(dtype)
    copies = y.reshape(5, 8, -1)
    expected = torch.zeros(5, 1100)
    for j in range(8):
        expected += copies[:, j] * w[:, j : j + 1]
    assert torch.equal(combine(y, w), expected.to(dtype))


ROUTINGS = {
    "uneven": lambda g: torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(9)]),
    "one expert": lambda g: torch.full((6, 2), 1),
    "one token": lambda g: torch.tensor([[3, 0]]),
    "outside": lambda g: torch.tensor([[0, -1], [E, 2], [2, 1], [-1, E]]),
    "many tokens": lambda g: torch.randint(0, E, (70, 2), generator=g),  # tiles of 64 tokens, rows quantized apart
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_block_is_the_composition_of_its_steps(routing, dtype):
    gate_up, down = _experts()
    g = torch.Generator().manual_seed(len(routing))
    ids = ROUTINGS[routing](g)
    weights = torch.rand(ids.shape, generator=g).softmax(-1).to(dtype)
    x = random_act(ids.shape[0], H, dtype=dtype, seed=len(routing))
    triton = get_backend("triton")
    y = mxgemm.moe_experts(x, ids, weights, gate_up, down)
    steps = GroupedWeights.run_experts(triton, x, ids, weights, gate_up, down)
    assert y.dtype == dtype and torch.equal(y, steps)
    if routing == "outside":  # a copy routed outside [0, E) adds what a copy of weight zero adds
        kept = torch.where((ids >= 0) & (ids < E), ids, 0)
        zeroed = torch.where((ids >= 0) & (ids < E), weights, torch.zeros_like(weights))
        assert torch.equal(y, mxgemm.moe_experts(x, kept, zeroed, gate_up, down))


def test_a_shape_of_the_block_is_planned_once_with_gate_ups_plans(monkeypatch):
    """``mxgemm::moe_experts`` plans each (tokens, top-k, dtype) once (its tactics looked up then) and keeps the plan
    with gate/up's plans; another routing of the shape reuses it, another shape or a new tuning generation plans
    anew, and the plan's bits are those of the call it stands for."""
    gate_up, down = _experts()
    triton = get_backend("triton")
    made = []
    plan_experts = type(triton).plan_experts

    def counted(self, gu, dn, tokens, topk, dtype, tactics):
        made.append((tokens, topk, dtype))
        return plan_experts(self, gu, dn, tokens, topk, dtype, tactics)

    monkeypatch.setattr(type(triton), "plan_experts", counted)
    g = torch.Generator().manual_seed(0)
    w = torch.rand(3, 2, generator=g).softmax(-1).bfloat16()
    x = random_act(3, H)
    for ids in (torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.tensor([[3, 3], [0, 2], [-1, 1]])):
        y = mxgemm.moe_experts(x, ids, w, gate_up, down)
        assert torch.equal(y, GroupedWeights.run_experts(triton, x, ids, w, gate_up, down))
    assert made == [(3, 2, torch.bfloat16)]
    mxgemm.moe_experts(random_act(5, H), torch.zeros(5, 2, dtype=torch.long), w[:1].expand(5, 2), gate_up, down)
    mxgemm.tuning.changed()
    mxgemm.moe_experts(x, ids, w, gate_up, down)
    assert made == [(3, 2, torch.bfloat16), (5, 2, torch.bfloat16), (3, 2, torch.bfloat16)]
    bf16 = torch.bfloat16
    assert [key[:3] for key in gate_up.plans.experts] == [(3, 2, bf16), (5, 2, bf16), (3, 2, bf16)]  # 3: generations
    assert not gate_up.plans.launch
    assert not down.plans


def test_every_config_shape_of_the_fused_projections():
    from mxgemm.kernels.grouped.fp8 import GroupedConfig, grouped_block_linear, grouped_down, grouped_gate_up
    from mxgemm.kernels.grouped.gemv import GemvConfig
    from mxgemm.kernels.grouped.routing import sort_by_expert

    gate_up, down = _experts()
    ids = torch.randint(0, E, (11, 2), generator=torch.Generator().manual_seed(5))
    x = random_act(11, H)
    offsets, src = sort_by_expert(ids, E)
    gu, dn = gate_up.tensors, down.tensors
    configs = (GroupedConfig(32, 16), GroupedConfig(256, 32, 8), GroupedConfig(64, 16, quantized=True))
    for config in (*configs, GemvConfig(32, 2), GemvConfig(16, 1, 2)):
        half = dataclasses.replace(config, bn=max(config.bn // 2, 16))
        rows = x[src.long() // 2]
        both = grouped_block_linear(rows, gu["qdata"].view(torch.uint8), gu["block_scale"], offsets, 2 * I, half)
        gate, up = both.chunk(2, -1)
        product = grouped_gate_up(x, gu["qdata"].view(torch.uint8), gu["block_scale"], offsets, src, 2, config)
        assert torch.equal(product, torch.nn.functional.silu(gate) * up), config
        y = grouped_down(product, dn["qdata"].view(torch.uint8), dn["block_scale"], offsets, src, H, config)
        plain = grouped_block_linear(product, dn["qdata"].view(torch.uint8), dn["block_scale"], offsets, H, config)
        assert torch.equal(y[src.long()], plain), config


@pytest.mark.parametrize("per_expert", [2, 4, 64])
def test_every_grouped_tactic_gives_the_same_bits(per_expert):
    """The autotuner's grouped tactics (the Triton kernel's configs of each regime, the GEMV's up to 2 rows an expert;
    the wgmma kernel's on SM90) trade speed only: on CPU every one the backend offers answers the default's bits, the
    GEMV's (fp32 sums in another order) within 1e-6 of them."""
    from mxgemm.kernels.grouped.gemv import GemvConfig

    backend = get_backend("triton")
    gate_up, _ = _experts()
    tactics = backend.grouped_tactics(per_expert, gate_up)
    gemvs = [t for t in tactics if isinstance(t.config, GemvConfig)]
    assert len(tactics) >= 3 and bool(gemvs) == (per_expert <= 2) and all(t.config.valid() for t in gemvs)
    x = random_act(per_expert * E + 3, H, seed=per_expert)
    offsets = torch.arange(1, E + 1, dtype=torch.int32) * per_expert
    ys = [backend.run_grouped(x, gate_up, offsets, t) for t in tactics]
    assert torch.equal(ys[0][-3:], torch.zeros_like(ys[0][-3:]))
    for t, y in zip(tactics[1:], ys[1:], strict=True):
        if t in gemvs:
            assert torch.equal(y[-3:], ys[0][-3:]) and (y - ys[0]).float().norm() <= 1e-6 * ys[0].float().norm(), t
        else:
            assert torch.equal(y, ys[0]), t


def test_the_routed_blocks_c_launch_refuses_what_it_cannot_run():
    """``ExpertsLaunch.make`` (the wgmma path's block in one C call) names, in one line, a config the grouped wgmma
    kernel cannot run and activations it does not take, before it looks for a GPU."""
    from mxgemm.kernels.grouped.wgmma import ExpertsLaunch, WgmmaConfig

    gate_up, down = _experts()
    with pytest.raises(ValueError, match="cannot run"):
        ExpertsLaunch.make(4, 2, gate_up, down, torch.bfloat16, WgmmaConfig(tn=32), WgmmaConfig())
    with pytest.raises(ValueError, match="bf16/fp16 tokens"):
        ExpertsLaunch.make(4, 2, gate_up, down, torch.float32, WgmmaConfig(), WgmmaConfig())
    with pytest.raises(ValueError, match="bf16/fp16 tokens"):
        ExpertsLaunch.make(0, 2, gate_up, down, torch.bfloat16, WgmmaConfig(), WgmmaConfig())
