"""Shared test helpers: error metrics and random MX weights (never zeros)."""

from __future__ import annotations

import math

import torch

import mxgemm


def sqnr_db(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    noise = (out.double() - ref).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.norm().item() / noise)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return (out.double() - ref).norm().item() / ref.norm().item()


def random_mx_weight(n: int, k: int, *, seed: int = 0, device="cpu", scale: float = 0.02, elem_dtype=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * scale
    t = mxgemm.quantize(w.to(device), elem_dtype=elem_dtype or torch.float8_e4m3fn)
    return t.qdata, t.scale


def skip_unless_backend_runs(name: str) -> None:
    """Skip the calling test (or module fixture) with the backend's own reason when it cannot run here."""
    import pytest

    answer = mxgemm.backends.get_backend(name).check_device(mxgemm.describe_device())
    if not answer.available:
        pytest.skip(f"{name} unavailable: {answer.reason}")


def hide_package(monkeypatch, name: str) -> None:
    """Make ``importlib.util.find_spec(name)`` answer None, as for a package that is not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == name else real(n, *a))


def random_act(m: int, k: int, *, seed: int = 1, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(device=device, dtype=dtype)


def hybrid_operands(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, *, quantized: bool):
    """The exact fp32 operands one ``hybrid_sm90`` regime multiplies: activations 1x128-quantized (``quantized``)
    or as given, and the weight re-encoded to 128x128 blocks."""
    from mxgemm.block128 import dequantize_1x128, quantize_1x128, reencode_block128

    xe = dequantize_1x128(*quantize_1x128(x)) if quantized else x.float()
    return xe, reencode_block128(q, s).dequantize()


def hybrid_twin(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, *, quantized: bool) -> torch.Tensor:
    """The emulated twin of one ``hybrid_sm90`` regime: activations 1x128-quantized (``quantized``) or as given,
    the weight re-encoded to 128x128 blocks."""
    from mxgemm.backends.emulation import EmulationBackend, emulate_linear

    weight = EmulationBackend().prepare(q, s, "hybrid-block128", crossover=1 if quantized else 2**31)
    return emulate_linear(x, weight, None)


# Per-element allowance for the order of a GEMM's sums, past the output's rounding, relative to sum(|x_i w_i|) (the
# products' magnitudes). Measured on the H200 (lab/results/ulp-margins-h200.json): the exact paths' fp32
# accumulation errs by at most 2^-21.1 of it (Triton) and 2^-28 (the small-M kernel), 2^-18 allowed; Hopper's FP8
# tensor cores keep about 14 bits while they sum each 128-deep block, and the quantized paths err by at most 2^-12.9
# (cuBLASLt) and 2^-13.7 (ours), 2^-11 allowed.
FP32_SUMS = "fp32"
FP8_TENSOR_CORE_SUMS = "fp8-tensor-core"


def exact_product(x_eff, w_eff, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x_eff @ w_eff.T + bias``, ``|x_eff| @ |w_eff|.T + |bias|``) in fp64: the exact product of the operands a
    path multiplies, and the magnitudes its sums run over."""
    ref = x_eff.double() @ w_eff.double().T
    mag = x_eff.double().abs() @ w_eff.double().abs().T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    return ref, mag


def assert_within_ulp(y, product, *, sums: str = FP32_SUMS, what: str = "") -> None:
    """Element by element: ``y`` is within one ulp of its dtype (bf16/fp16) of the exact product of the operands it
    computes (``product``: :func:`exact_product`), plus the allowance of its summation order (``sums``). An element
    off by more (a dropped block, bias or scale, an unwritten output) fails, naming the worst one."""
    ref, mag = product
    order = 2.0**-18 if sums == FP32_SUMS else 2.0**-11
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[y.dtype]
    tiny = torch.finfo(y.dtype).smallest_normal
    top = torch.maximum(y.double().abs(), ref.abs()).clamp_min(tiny)
    ulp = torch.exp2(torch.floor(torch.log2(top)) - mantissa)
    err = (y.double() - ref).abs()
    bound = ulp + order * mag
    bad = ~(err <= bound)  # NaN anywhere fails
    if bad.any():
        i = int(torch.argmax(torch.where(bad, err / bound, torch.zeros_like(err)).nan_to_num(float("inf"))))
        r, c = divmod(i, y.shape[1])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {y.numel()} elements beyond one ulp + summation order; worst [{r}, {c}]: "
            f"{float(y[r, c])} against {float(ref[r, c])} (ulp {float(ulp[r, c]):.3g}, "
            f"allowed {float(bound[r, c]):.3g})"
        )


def poison_cuda_allocator() -> None:
    """Fill the memory PyTorch's caching allocator hands out next with NaN: its cache emptied, then blocks of both of
    its pools (small, under 1 MiB, and large) written with NaN and freed. An output a kernel leaves unwritten then
    reads NaN."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # bf16 NaN (0x7fc0) in every two bytes: NaN read as bf16, fp16 or fp32
    small = [torch.full((1 << 19,), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(64)]  # 1 MiB
    large = torch.full((1 << 29,), float("nan"), dtype=torch.bfloat16, device="cuda")  # 1 GiB
    torch.cuda.synchronize()
    del small, large


def kernels_launched(fn) -> list[str]:
    """The CUDA kernels ``fn`` launches, by name, as the profiler records them (skips where it records none)."""
    import pytest
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not names:
        pytest.skip("the profiler records no CUDA kernels here")
    return names


def guards_tag_safe(code) -> dict[str, bool]:
    """For the one compiled entry of ``code``: each guarded value's source and whether Dynamo may skip its subtree while
    the dicts it is read through keep their tags (recursive dict tags)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    (entry,) = _debug_get_cache_entry_list(code)
    safe, nodes = {}, [entry.guard_manager.root]
    while nodes:
        node = nodes.pop()
        nodes += node.get_child_managers()
        safe[node.get_source()] = node.is_tag_safe()
    return safe


def tiny_qwen3_moe(layers: int = 2, *, hidden: int = 64, width: int = 32, experts: int = 4, seed: int = 0):
    """A tiny random Qwen3-MoE causal LM in bf16 (transformers' 3-D experts, top-2 routing), seeded."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=128,
        moe_intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=experts,
        num_experts_per_tok=2,
    )
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)


def tiny_llama_folder(folder, *, layers: int = 1, vocab: int = 128, dtype: torch.dtype = torch.float32):
    """A tiny random Llama (seeded) saved as a Hugging Face model folder at ``folder``; returns it."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(folder)
    return folder


def compressed_tensors_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' own MXFP8 quantization of ``w`` [N, K] (its qparams, quantize and scale compression):
    (float8_e4m3fn elements, uint8 E8M0 scales)."""
    from compressed_tensors.compressors.mx_utils import compress_mx_scale
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(
        num_bits=8, type="float", symmetric=True, group_size=32, strategy="group", scale_dtype=torch.uint8
    )
    blocks = w.reshape(w.shape[0], -1, 32)
    scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
    return ct_quantize(w, scale, zero, args, dtype=torch.float8_e4m3fn), compress_mx_scale(scale, torch.uint8)
