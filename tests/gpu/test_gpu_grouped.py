"""The grouped FP8 kernel of a mixture of experts on the GPU: every config and routing (the GEMV's too) within the FP8
tensor cores' rounding of the twin, outputs poisoned beforehand fully written, one CUDA graph replaying any routing
of its token count, compile fullgraph, and the prepared copy's bytes per parameter."""

import pytest
import torch
from helpers import (
    FP8_TENSOR_CORE_SUMS,
    assert_within_ulp,
    exact_product,
    hybrid_operands,
    poison_cuda_allocator,
    random_act,
    random_mx_weight,
)

import mxgemm
from mxgemm.backends import get_backend
from mxgemm.kernels.grouped.fp8 import GroupedConfig, grouped_block_linear
from mxgemm.kernels.grouped.gemv import GemvConfig
from mxgemm.kernels.grouped.quant import quantize_rows
from mxgemm.kernels.grouped.wgmma import WgmmaConfig, grouped_wgmma, wgmma_status

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _fp8_gpu():
    answer = get_backend("triton").check_device(mxgemm.describe_device())
    if answer:
        answer = get_backend("triton").check_grouped(mxgemm.describe_device())
    if not answer:
        pytest.skip(answer.reason)


def _experts(e, n, k, seed=0):
    pairs = [random_mx_weight(n, k, seed=seed + i, device="cuda") for i in range(e)]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).cuda()


def _check(y, x, q, s, counts, what):
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = x[start : start + count]
            product = exact_product(*hybrid_operands(rows, q[e], s[e], quantized=True))
            assert_within_ulp(y[start : start + count], product, sums=FP8_TENSOR_CORE_SUMS, what=f"{what} expert {e}")
        start += count
    assert torch.equal(y[start:], torch.zeros_like(y[start:])), f"{what}: rows past the last expert"


ROUTINGS = {
    "uneven": [3, 0, 70, 1, 0, 200, 5, 9],
    "one expert": [0, 0, 0, 300, 0, 0, 0, 0],
    "one token": [0, 0, 0, 0, 0, 0, 1, 0],
    "none": [0] * 8,
}
CONFIGS = [
    GroupedConfig(bn, bm, w, st, quantized)
    for bn, bm in ((64, 16), (128, 64), (128, 128), (256, 128))
    for w, st in ((4, 3), (8, 4))
    for quantized in (False, True)
] + [
    GemvConfig(bn, kb, w, st)
    for bn, kb, w, st in ((16, 1, 2, 1), (32, 2, 4, 3), (64, 4, 4, 1), (128, 2, 8, 2), (16, 16, 4, 1), (32, 8, 8, 1))
]
CONFIGS.append(GemvConfig(16, 4))  # the default at one row an active expert (triton_w8a16._default_gemv)


@pytest.mark.parametrize("n,k", [(130, 160), (1536, 2048), (2048, 768)])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_every_config_and_routing_matches_the_twin(n, k, routing):
    q, s = _experts(8, n, k)
    w = mxgemm.prepare_grouped_weight(q, s, backend="triton")
    counts = ROUTINGS[routing]
    x = random_act(sum(counts) + 3, k, device="cuda", seed=n + k)
    offsets = _offsets(counts)
    qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
    for config in [None, *CONFIGS]:
        poison_cuda_allocator()
        y = grouped_block_linear(x, qd, bs, offsets, n, config)
        _check(y, x, q, s, counts, str(config))


WGMMA_CONFIGS = [WgmmaConfig(tn, wn, st) for tn in (64, 128) for wn in (64, 128) for st in (2, 4, 6)]
PERSISTENT = [WgmmaConfig(c.tn, c.wn, c.stages, persistent=True) for c in WGMMA_CONFIGS]


def _need_wgmma():
    answer = wgmma_status(torch.cuda.get_device_capability())
    if not answer:
        pytest.skip(answer.reason)


@pytest.mark.parametrize("n,k", [(130, 160), (1536, 2048), (2048, 768)])
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_wgmma_config_and_routing_matches_the_twin(n, k, routing, dtype):
    """The TMA/wgmma kernel on rows quantized apart: each expert's rows within the tensor cores' rounding of the
    twin, rows past the last expert zeros, every output row written, the persistent grid's bits those of a CTA per
    tile; with ``dst`` each row lands at its place."""
    _need_wgmma()
    q, s = _experts(8, n, k)
    w = mxgemm.prepare_grouped_weight(q, s, backend="triton")
    counts = ROUTINGS[routing]
    x = random_act(sum(counts) + 3, k, device="cuda", seed=n + k, dtype=dtype)
    offsets = _offsets(counts)
    qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
    xq, xs = quantize_rows(x)
    for config, persistent in zip(WGMMA_CONFIGS, PERSISTENT, strict=True):
        poison_cuda_allocator()
        y = grouped_wgmma(xq, xs, x.shape[0], qd, bs, offsets, n, dtype, config)
        _check(y, x, q, s, counts, str(config))
        poison_cuda_allocator()
        assert torch.equal(grouped_wgmma(xq, xs, x.shape[0], qd, bs, offsets, n, dtype, persistent), y), persistent
    dst = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(n)).to(torch.int32).cuda()
    poison_cuda_allocator()
    scattered = grouped_wgmma(xq, xs, x.shape[0], qd, bs, offsets, n, dtype, WGMMA_CONFIGS[-1], dst=dst)
    assert torch.equal(scattered[dst.long()], y)


@pytest.mark.parametrize("tn", [64, 128])
def test_persistent_ctas_find_every_tile_of_many_experts(tn):
    """80 experts (three of the warp's 32-expert scan steps), a third of them empty and one with 10 tiles' rows: the
    persistent grid, whose CTAs take tiles in turn and carry their scan from one tile to the next, writes what a CTA
    per tile does, within the tensor cores' rounding of the twin."""
    _need_wgmma()
    e, n, k = 80, 256, 256
    q, s = _experts(e, n, k, seed=3)
    w = mxgemm.prepare_grouped_weight(q, s, backend="triton")
    g = torch.Generator().manual_seed(tn)
    counts = [0 if i % 3 == 1 else int(torch.randint(1, 150, (1,), generator=g)) for i in range(e)]
    counts[41] = 10 * tn
    x = random_act(sum(counts) + 5, k, device="cuda", seed=tn, dtype=torch.bfloat16)
    qd, bs = w.tensors["qdata"].view(torch.uint8), w.tensors["block_scale"]
    xq, xs = quantize_rows(x)
    args = (xq, xs, x.shape[0], qd, bs, _offsets(counts), n, torch.bfloat16)
    poison_cuda_allocator()
    y = grouped_wgmma(*args, WgmmaConfig(tn, 64, 4, persistent=True))
    _check(y, x, q, s, counts, "persistent")
    assert torch.equal(y, grouped_wgmma(*args, WgmmaConfig(tn, 64, 4)))


def test_fp16_and_the_op():
    q, s = _experts(8, 256, 512)
    w = mxgemm.prepare_grouped_weight(q, s)
    assert w.backend == "triton" and w.recipe == "w8a8-block"
    counts = ROUTINGS["uneven"]
    x = random_act(sum(counts), 512, device="cuda", dtype=torch.float16)
    _check(mxgemm.grouped_linear(x, w, _offsets(counts)), x, q, s, counts, "fp16")


@pytest.mark.parametrize("rows", [64, 2048], ids=["triton-kernel", "wgmma-kernel-on-sm90"])
def test_one_graph_replays_any_routing_of_its_token_count(rows):
    q, s = _experts(16, 512, 1024)
    w = mxgemm.prepare_grouped_weight(q, s)
    static_x = random_act(rows, 1024, device="cuda")
    static_off = _offsets([rows] + [0] * 15)
    eager = mxgemm.grouped_linear(static_x, w, static_off)  # compiled outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = mxgemm.grouped_linear(static_x, w, static_off)
    g = torch.Generator().manual_seed(0)
    for trial in range(4):
        cuts = torch.sort(torch.randint(0, rows + 1, (15,), generator=g)).values.tolist()
        counts = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
        static_x.copy_(random_act(rows, 1024, device="cuda", seed=trial))
        static_off.copy_(_offsets(counts))
        graph.replay()
        eager = mxgemm.grouped_linear(static_x, w, static_off)
        assert torch.equal(static_y, eager), counts
        _check(static_y, static_x, q, s, counts, f"replay {counts}")


def test_compile_fullgraph_matches_eager():
    q, s = _experts(8, 256, 512)
    w = mxgemm.prepare_grouped_weight(q, s)

    def experts(x, offsets):
        return mxgemm.grouped_linear(x, w, offsets) * 2

    compiled = torch.compile(experts, fullgraph=True)
    x = random_act(40, 512, device="cuda")
    for counts in ([5, 0, 30, 5, 0, 0, 0, 0], [0] * 7 + [40]):
        assert torch.equal(compiled(x, _offsets(counts)), experts(x, _offsets(counts)))


def test_bytes_per_parameter():
    q, s = _experts(16, 1536, 2048)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    w = mxgemm.prepare_grouped_weight(q, s)
    torch.cuda.synchronize()
    assert 1.0 <= (torch.cuda.memory_allocated() - before) / q.numel() <= 1.07
    assert 1.0 <= w.nbytes / q.numel() <= 1.07


def test_a_tiny_moe_model_runs_its_experts_on_the_grouped_kernel():
    """quantize_model on the GPU with ``auto``: the experts on the grouped kernel, the model's logits within FP8
    quantization noise of bf16's, generate runs, and one CUDA graph of the forward replays other tokens (other
    routings) as eager computes them."""
    import copy

    pytest.importorskip("transformers")
    from helpers import sqnr_db, tiny_qwen3_moe

    from mxgemm.moe import MXFP8Experts

    model = tiny_qwen3_moe(hidden=256, width=128, experts=8).cuda()
    reference = copy.deepcopy(model)
    report = mxgemm.quantize_model(model)
    experts = [m for m in model.modules() if isinstance(m, MXFP8Experts)]
    assert len(experts) == 2 and {(m.backend, m.recipe) for m in experts} == {("triton", "w8a8-block")}, str(report)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (2, 12), generator=g).cuda()
    with torch.no_grad():
        logits, expected = model(ids).logits, reference(ids).logits
        assert torch.isfinite(logits).all() and sqnr_db(logits.float(), expected.float()) >= 20
        assert model.generate(ids, max_new_tokens=8, do_sample=False).shape == (2, 20)
        static_ids = ids.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = model(static_ids, use_cache=False).logits
        for _ in range(3):
            static_ids.copy_(torch.randint(0, 128, (2, 12), generator=g))
            graph.replay()
            assert torch.equal(static_logits, model(static_ids, use_cache=False).logits)


def _block(e, hidden, width, seed=0):
    return [
        mxgemm.prepare_grouped_weight(*_experts(e, n, k, seed=seed + n), backend="triton")
        for n, k in ((2 * width, hidden), (hidden, width))
    ]


def _top_k(tokens, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, e, generator=g).topk(k, dim=1).indices
    return ids.cuda(), torch.rand(tokens, k, generator=g).softmax(-1).bfloat16().cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_times_up_is_pytorchs_for_every_value(dtype):
    """The fused gate/up epilogue's ``silu(gate) * up`` on every finite bf16 / fp16 ``gate`` (``up`` 1.5): the bits
    of ``torch.nn.functional.silu(gate) * up`` on this GPU."""
    import triton
    import triton.language as tl

    from mxgemm.kernels.grouped.fp8 import _silu_times, rounded

    @triton.jit
    def kernel(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ty = o_ptr.dtype.element_ty
        g = tl.load(g_ptr + i, mask=i < n).to(tl.float32)
        u = tl.load(u_ptr + i, mask=i < n).to(tl.float32)
        tl.store(o_ptr + i, rounded(_silu_times(g, u, ty, False), ty, False).to(ty), mask=i < n)

    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).cuda()
    gate = gate[torch.isfinite(gate)]
    up = torch.full_like(gate, 1.5)
    out = torch.empty_like(gate)
    kernel[(triton.cdiv(gate.numel(), 1024),)](gate, up, out, gate.numel(), BLOCK=1024)
    expected = torch.nn.functional.silu(gate) * up
    same = (out.view(torch.int16) == expected.view(torch.int16)) | (torch.isnan(out) & torch.isnan(expected))
    assert same.all(), gate[~same][:8]


@pytest.mark.parametrize("tokens", [1, 5, 64, 700])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_block_is_the_composition_of_its_steps(tokens, dtype):
    """``moe_experts`` on the Triton backend (sort, gate/up with the product, down written back in token order, the
    weighted sum: four launches) bit for bit its steps run apart, on a poisoned allocator, copies routed outside
    [0, E) adding nothing; 700 tokens (175 rows per expert) take the wgmma kernel on SM90, elsewhere the configs
    that quantize rows apart."""
    from mxgemm.backends.capabilities import GroupedWeights

    gate_up, down = _block(16, 512, 384)
    ids, weights = _top_k(tokens, 16, 4, seed=tokens)
    ids[0, 1], ids[-1, 0] = -1, 16  # expert parallelism's other ranks' experts
    x = random_act(tokens, 512, device="cuda", dtype=dtype, seed=tokens)
    weights = weights.to(dtype)
    poison_cuda_allocator()
    y = mxgemm.moe_experts(x, ids, weights, gate_up, down)
    steps = GroupedWeights.run_experts(get_backend("triton"), x, ids, weights, gate_up, down)
    assert torch.isfinite(y).all() and torch.equal(y, steps)


@pytest.mark.parametrize(
    "tokens, experts, k, ids_dtype, dtype, hidden",
    [
        (700, 16, 4, torch.int64, torch.bfloat16, 512),
        (1, 16, 3, torch.int64, torch.bfloat16, 512),  # 3 copies: one sorting block, rows padded to 4
        (3000, 16, 8, torch.int32, torch.float16, 512),  # 24000 copies: 24 sorting blocks
        (600, 256, 8, torch.int64, torch.bfloat16, 256),  # DeepSeek-V3's 256 experts: the sort's shared memory
        (257, 64, 6, torch.int16, torch.bfloat16, 2080),  # ids converted; combine's columns past a 2048 block
        (1001, 16, 7, torch.int64, torch.bfloat16, 1024),  # 7007 copies: the wide gathered quantizer, a padded row
    ],
)
def test_the_routed_blocks_c_launch_is_its_launches_one_by_one(tokens, experts, k, ids_dtype, dtype, hidden):
    """The wgmma path's block in one C call (ExpertsLaunch: CUDA sort, gathered quantization, gate/up, gated
    quantization, down, weighted sum) bit for bit the Triton backend's launches one by one (Triton sort, quantizers
    and sum around the same GEMMs), for the default configs and a persistent / 64-row pair, copies routed outside
    [0, E) adding nothing, on a poisoned allocator."""
    from mxgemm.backends.base import Tactic
    from mxgemm.backends.triton_w8a16 import Path
    from mxgemm.kernels.grouped.wgmma import ExpertsLaunch

    if not wgmma_status(torch.cuda.get_device_capability()):
        pytest.skip("the grouped wgmma kernel runs on SM90 only")
    gate_up, down = _block(experts, hidden, 128)
    ids, weights = _top_k(tokens, experts, k, seed=tokens)
    ids[0, k - 1], ids[-1, 0] = -1, experts  # expert parallelism's other ranks' experts
    ids = ids.to(ids_dtype)
    x = random_act(tokens, hidden, device="cuda", dtype=dtype, seed=tokens)
    weights = weights.to(dtype)
    triton = get_backend("triton")
    for first, second in [(WgmmaConfig(), WgmmaConfig()), (WgmmaConfig(64, 128, 6, True), WgmmaConfig(64, 64, 4))]:
        tactics = (Tactic(Path.WGMMA, first), Tactic(Path.WGMMA, second))
        launch = ExpertsLaunch.make(tokens, k, gate_up, down, dtype, first, second)
        poison_cuda_allocator()
        y = launch(x, ids, weights, gate_up, down)
        steps = triton.run_experts(x, ids.long(), weights, gate_up, down, tactics)
        assert torch.isfinite(y).all() and torch.equal(y, steps), (first, second)


@pytest.mark.parametrize("tokens", [16, 1024], ids=["triton-kernel", "wgmma-kernel-on-sm90"])
def test_one_graph_replays_any_routing_of_the_block(tokens):
    gate_up, down = _block(32, 1024, 512)
    static_x = random_act(tokens, 1024, device="cuda")
    static_ids, static_w = _top_k(tokens, 32, 8, seed=0)
    mxgemm.moe_experts(static_x, static_ids, static_w, gate_up, down)  # compiled outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = mxgemm.moe_experts(static_x, static_ids, static_w, gate_up, down)
    for trial in range(1, 5):
        ids, w = _top_k(tokens, 32, 8, seed=trial)
        if trial == 4:
            ids[:] = 3  # every copy on one expert
        static_x.copy_(random_act(tokens, 1024, device="cuda", seed=trial))
        static_ids.copy_(ids)
        static_w.copy_(w)
        graph.replay()
        assert torch.equal(static_y, mxgemm.moe_experts(static_x, static_ids, static_w, gate_up, down)), trial


def test_eager_experts_calls_from_two_threads_keep_their_own_bits(monkeypatch):
    """Two threads calling one ``MXFP8Experts`` with tokens of their own of one shape, 20 times each while the other
    does: every answer the bits of a direct call on its own tokens, one graph between them."""
    import threading

    from mxgemm.moe import MXFP8Experts

    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "1")
    gate_up, down = _block(32, 1024, 512)
    experts = MXFP8Experts(gate_up, down)
    calls = []
    for seed in range(2):
        x = random_act(4, 1024, device="cuda", seed=seed)
        ids, w = _top_k(4, 32, 8, seed=seed + 10)
        calls.append((x, ids, w, mxgemm.moe_experts(x, ids, w, gate_up, down)))
    wrong = []

    def work(x, ids, w, want):
        for i in range(20):
            if not torch.equal(experts(x, ids, w), want):
                wrong.append(i)

    threads = [threading.Thread(target=work, args=c) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not wrong and len(experts._graphs) == 1


def test_eager_graphs_capture_after_every_earlier_holder_is_freed(monkeypatch):
    """The allocator releases a graph memory pool once no graph uses it and refuses it to later captures: holders made
    after every earlier one was freed capture in a new pool, and replay the direct call's bits."""
    import gc

    from mxgemm.graphs import EagerGraphs

    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "1")
    x = torch.randn(64, device="cuda")
    for holder in range(3):
        graphs = EagerGraphs()
        for _ in range(3):
            assert torch.equal(graphs(lambda t: t * 2 + 1, x), x * 2 + 1)
        assert len(graphs) == 1, holder
        del graphs
        gc.collect()


def test_eager_experts_calls_replay_graphs_with_the_direct_calls_bits(monkeypatch):
    """``MXFP8Experts``' eager calls of up to GRAPHED_TOKENS tokens with MXGEMM_EAGER_GRAPHS=1: the first of a shape
    runs directly, the second captures, every later one replays; each answers the bits of a direct ``moe_experts``
    call for its own routing, the outputs held from earlier calls unchanged. Longer calls, gradients asked for, a side
    stream, a caller's own capture and MXGEMM_EAGER_GRAPHS=0 run directly; inference mode has graphs of its own."""
    from mxgemm.moe import GRAPHED_TOKENS, MXFP8Experts

    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "1")
    gate_up, down = _block(32, 1024, 512)
    experts = MXFP8Experts(gate_up, down)
    held = []
    for trial in range(5):
        for tokens in (1, 5):
            x = random_act(tokens, 1024, device="cuda", seed=trial)
            ids, w = _top_k(tokens, 32, 8, seed=trial * 7 + tokens)
            y = experts(x, ids, w)
            assert torch.equal(y, mxgemm.moe_experts(x, ids, w, gate_up, down)), (trial, tokens)
            held.append((y, y.clone()))
    assert len(experts._graphs) == 2
    assert all(torch.equal(y, copy) for y, copy in held)

    long = random_act(GRAPHED_TOKENS + 1, 1024, device="cuda")
    ids, w = _top_k(GRAPHED_TOKENS + 1, 32, 8, seed=1)
    for _ in range(3):
        assert torch.equal(experts(long, ids, w), mxgemm.moe_experts(long, ids, w, gate_up, down))
    x = random_act(3, 1024, device="cuda").requires_grad_()
    ids, w = _top_k(3, 32, 8, seed=2)
    for _ in range(3):
        experts(x, ids, w)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        for _ in range(3):
            experts(x.detach(), ids, w)
    torch.cuda.synchronize()
    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "0")
    for _ in range(3):
        experts(x.detach(), ids, w)
    assert len(experts._graphs) == 2

    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "1")
    static_x, (static_ids, static_w) = random_act(2, 1024, device="cuda"), _top_k(2, 32, 8, seed=3)
    experts(static_x, static_ids, static_w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the caller's capture: the call is captured directly, no graph of ours
        static_y = experts(static_x, static_ids, static_w)
    graph.replay()
    assert torch.equal(static_y, mxgemm.moe_experts(static_x, static_ids, static_w, gate_up, down))
    assert len(experts._graphs) == 2

    x, (ids, w) = random_act(1, 1024, device="cuda"), _top_k(1, 32, 8, seed=4)
    with torch.inference_mode():  # a graph of its own: inference tensors cannot be written outside the mode
        for _ in range(3):
            assert torch.equal(experts(x, ids, w), mxgemm.moe_experts(x, ids, w, gate_up, down))
    assert len(experts._graphs) == 3
    assert torch.equal(experts(x, ids, w), mxgemm.moe_experts(x, ids, w, gate_up, down))


def test_moe_blocks_replay_router_and_experts_with_the_direct_calls_bits(monkeypatch):
    """A quantized Qwen3-MoE block's eager calls of up to GRAPHED_TOKENS tokens replay one graph of its router and
    experts: each call the bits of the block run directly (MXGEMM_EAGER_GRAPHS=0) on its own tokens, one graph a
    shape. A hook inside the block, or more tokens, run directly; a changed attribute (the router's top_k) captures
    anew; a block whose forward changes its own state runs directly from its first call."""
    from helpers import tiny_qwen3_moe

    from mxgemm.moe import GRAPHED_TOKENS
    from mxgemm.moe_blocks import is_graphed_block

    def direct(block, x):
        monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "0")
        try:
            return block(x)
        finally:
            monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "1")

    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "1")
    model = tiny_qwen3_moe(layers=1, hidden=256, width=128, experts=8).cuda()
    mxgemm.quantize_model(model)
    block = model.model.layers[0].mlp
    assert is_graphed_block(block)
    graphs = block._mxgemm_block_graphs
    with torch.no_grad():
        for trial in range(4):
            for tokens in (1, 3):
                x = random_act(tokens, 256, device="cuda", seed=trial * 7 + tokens)[None]
                assert torch.equal(block(x), direct(block, x)), (trial, tokens)
        assert len(graphs) == 2
        seen = []
        hook = block.gate.register_forward_hook(lambda *_: seen.append(True))
        assert torch.equal(block(x), direct(block, x)) and seen == [True, True] and len(graphs) == 2
        hook.remove()
        block.gate.top_k = 1
        for seed in range(3):
            x = random_act(3, 256, device="cuda", seed=seed)[None]
            assert torch.equal(block(x), direct(block, x)), seed
        assert len(graphs) == 3
        long = random_act(GRAPHED_TOKENS + 1, 256, device="cuda")[None]
        for _ in range(3):
            assert torch.equal(block(long), direct(block, long))
        assert len(graphs) == 3

    class Counting(type(block).__mro__[1]):
        def forward(self, hidden_states):
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(hidden_states)

    model = tiny_qwen3_moe(layers=1, hidden=256, width=128, experts=8).cuda()
    model.model.layers[0].mlp.__class__ = Counting
    mxgemm.quantize_model(model)
    block = model.model.layers[0].mlp
    assert is_graphed_block(block)
    with torch.no_grad():
        for _ in range(3):
            block(random_act(2, 256, device="cuda")[None])
    assert block.calls == 3 and block._mxgemm_block_graphs is None


def test_calls_of_no_tokens_answer_zeros_without_a_graph(monkeypatch):
    """An experts module's and a graphed MoE block's eager calls of no tokens (an empty batch): zeros of their shape,
    run directly (no graph of nothing captured); the calls of tokens after them capture and replay as before."""
    from helpers import tiny_qwen3_moe

    from mxgemm.moe import MXFP8Experts

    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "1")
    gate_up, down = _block(32, 1024, 512)
    experts = MXFP8Experts(gate_up, down)
    none, (no_ids, no_w) = random_act(1, 1024, device="cuda")[:0], _top_k(1, 32, 8, seed=0)
    x, (ids, w) = random_act(2, 1024, device="cuda"), _top_k(2, 32, 8, seed=1)
    for _ in range(3):
        y = experts(none, no_ids[:0], no_w[:0])
        assert y.shape == (0, 1024) and y.dtype == torch.bfloat16
        y = experts(x, ids[:, :0], w[:, :0])  # no expert a token
        assert y.shape == (2, 1024) and not y.any()
    assert len(experts._graphs) == 0
    for _ in range(3):
        assert torch.equal(experts(x, ids, w), mxgemm.moe_experts(x, ids, w, gate_up, down))
    assert len(experts._graphs) == 1

    model = tiny_qwen3_moe(layers=1, hidden=256, width=128, experts=8).cuda()
    mxgemm.quantize_model(model)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        for _ in range(3):
            assert block(random_act(1, 256, device="cuda")[None, :0]).shape == (1, 0, 256)
        assert len(block._mxgemm_block_graphs) == 0
        for _ in range(3):
            block(random_act(2, 256, device="cuda")[None])
        assert len(block._mxgemm_block_graphs) == 1


def test_experts_moved_or_loaded_anew_run_their_new_weights(monkeypatch):
    """``MXFP8Experts`` built on the CPU and moved to the GPU prepare there for the backend ``auto`` resolves (the
    bits of experts built there), and back (the bits of experts built on the CPU); a state dict loaded into experts
    and into a graphed MoE block whose eager graphs replayed the old weights answers the new weights' bits (the
    graphs made anew, not replayed)."""
    from helpers import tiny_qwen3_moe

    from mxgemm.moe import MXFP8Experts

    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "1")
    mx = [mxgemm.quantize(torch.randn(shape) * 0.05) for shape in ((32, 1024, 1024), (32, 1024, 512))]
    tensors = [t for m in mx for t in (m.qdata, m.scale)]
    experts = MXFP8Experts.from_quantized(*tensors)
    assert experts.backend == "emulation"
    experts.cuda()
    here = MXFP8Experts.from_quantized(*(t.cuda() for t in tensors))
    assert experts.backend == here.backend == "triton" and experts.gate_up.device.type == "cuda"
    x, (ids, w) = random_act(3, 1024, device="cuda"), _top_k(3, 32, 8, seed=5)
    assert torch.equal(experts(x, ids, w), here(x, ids, w))
    experts.cpu()
    on_cpu = MXFP8Experts.from_quantized(*tensors)
    assert experts.backend == "emulation" and experts.gate_up.device.type == "cpu"
    assert torch.equal(experts(x.cpu(), ids.cpu(), w.cpu()), on_cpu(x.cpu(), ids.cpu(), w.cpu()))

    other = MXFP8Experts(*_block(32, 1024, 512, seed=9))
    for _ in range(3):  # the second call of these inputs captures a graph of the old weights, the others replay it
        before = here(x, ids, w)
    assert len(here._graphs) == 1
    here.load_state_dict(other.state_dict())
    for _ in range(3):
        assert torch.equal(here(x, ids, w), other(x, ids, w))
    assert not torch.equal(here(x, ids, w), before)

    model, donor = (tiny_qwen3_moe(layers=1, hidden=256, width=128, experts=8, seed=s).cuda() for s in (0, 1))
    for m in (model, donor):
        mxgemm.quantize_model(m)
    block, theirs = model.model.layers[0].mlp, donor.model.layers[0].mlp
    h = random_act(2, 256, device="cuda")[None]
    with torch.no_grad():
        for _ in range(3):
            before = block(h)
        model.load_state_dict(donor.state_dict())
        for _ in range(3):
            assert torch.equal(block(h), theirs(h))
    assert not torch.equal(block(h), before)


def test_a_model_quantized_on_the_cpu_runs_on_the_gpu_as_one_quantized_there():
    """A tiny Qwen3-MoE quantized on the CPU and moved to the GPU prepares every layer and the experts there for the
    backends ``auto`` resolves; ``mxgemm.fuse`` makes its q/k/v groups again; its logits are the bits of the same
    model quantized on the GPU."""
    import copy

    from helpers import tiny_qwen3_moe

    model = tiny_qwen3_moe(layers=1, hidden=256, width=128, experts=8)
    there = copy.deepcopy(model).cuda()
    mxgemm.quantize_model(model)
    mxgemm.quantize_model(there)
    model.cuda()
    assert "model.layers.0.self_attn: q_proj, k_proj, v_proj" in mxgemm.fuse(model)
    attention, experts = model.model.layers[0].self_attn, model.model.layers[0].mlp.experts
    assert attention.q_proj.backend == there.model.layers[0].self_attn.q_proj.backend != "emulation"
    assert experts.backend == "triton" and attention.q_proj.shared is not None
    tokens = torch.randint(0, 128, (2, 5), device="cuda")
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, there(tokens).logits)
