"""Where mxgemm's vLLM quantization config claims the experts of an MXFP8 checkpoint (``grouped_reason``), decided
on device descriptions, without vLLM: on Hopper and on a CPU it does; on an Ampere GPU, where only the emulation
would run them, and under a named backend without grouped weights, it leaves them to vLLM with the reason."""

import pytest

from mxgemm.device import DeviceInfo
from mxgemm.integrations.vllm_moe import grouped_reason

pytest.importorskip("triton")


def test_hopper_and_the_cpu_run_the_experts_ampere_leaves_them_to_vllm(monkeypatch):
    monkeypatch.delenv("MXGEMM_BACKEND", raising=False)
    assert grouped_reason(device=DeviceInfo("cuda", "H200", (9, 0))) == ""
    assert grouped_reason(device=DeviceInfo("cpu")) == ""
    ampere = grouped_reason(device=DeviceInfo("cuda", "A100", (8, 0)))
    assert "no backend runs grouped weights fast on this GPU" in ampere


def test_a_named_backend_without_grouped_weights_is_the_reason(monkeypatch):
    monkeypatch.delenv("MXGEMM_BACKEND", raising=False)
    reason = grouped_reason("hybrid_sm90", device=DeviceInfo("cuda", "H200", (9, 0)))
    assert "hybrid_sm90" in reason and "grouped" in reason


def test_one_line_says_what_runs_where_once_every_layer_taken_is_prepared(monkeypatch, caplog):
    """vLLM builds every layer before loading any weight: the line comes with the last prepared layer, once, counting
    each kind's layers by backend and naming what was left to vLLM."""
    import collections
    import functools
    import logging

    from mxgemm.integrations import vllm_log

    monkeypatch.setattr(vllm_log, "_taken", collections.Counter())
    monkeypatch.setattr(vllm_log, "_prepared", {})
    monkeypatch.setattr(vllm_log, "_left", {})
    monkeypatch.setattr(vllm_log, "_said", [])
    monkeypatch.setattr(vllm_log, "say_once", functools.cache(vllm_log.engine_logger.info))
    for kind in ("linear", "linear", "linear", "MoE", "MoE"):
        vllm_log.taken(kind)
    vllm_log.left("MXFP8 linear layers whose K is not a multiple of 32 on vLLM's own kernels")
    with caplog.at_level(logging.INFO, logger="vllm.mxgemm"):
        vllm_log.prepared("linear", "hybrid_sm90", "hybrid-block128")
        vllm_log.prepared("MoE", "triton", "w8a8-block")
        vllm_log.prepared("linear", "triton", "w8a16")
        vllm_log.prepared("MoE", "triton", "w8a8-block")
        assert caplog.messages == []  # a linear layer still to come
        vllm_log.prepared("linear", "hybrid_sm90", "hybrid-block128")
        vllm_log.prepared("linear", "hybrid_sm90", "hybrid-block128")  # a later load (a refit): no second line
    assert caplog.messages == [
        "mxgemm: 2 linear layers on hybrid_sm90 (hybrid-block128); 1 linear layer on triton (w8a16); 2 MoE layers on "
        "triton (w8a8-block); MXFP8 linear layers whose K is not a multiple of 32 on vLLM's own kernels"
    ]
