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
