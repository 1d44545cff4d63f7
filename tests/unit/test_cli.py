"""The command line runs and says what it should."""

import json
import subprocess
import sys

import torch

import mxgemm
from mxgemm.cli import main


def test_info(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "emulation" in out and "triton" in out and "auto" in out
    assert "needs a CUDA GPU" in out or "Triton kernel on" in out
    assert "torch" in out
    assert "tuning file (this GPU and environment): " in out and "tuning-cpu-" in out and "absent" in out
    assert "shipped tuning file: none for this GPU" in out
    assert "eager calls: the Python path" in out
    assert "MoE blocks' and experts' eager graphs (up to 64 tokens): on (MXGEMM_EAGER_GRAPHS=0 turns them off)" in out
    assert "route thresholds: measured on NVIDIA H200 (dense routes) and H100 80GB HBM3 (grouped weights)" in out


def test_bench_cpu_smoke(tmp_path, capsys):
    path = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    assert main(["bench", "--shapes", "2x64x128,1x32x64", "--json", str(path), "--markdown", str(md)]) == 0
    data = json.loads(path.read_text())
    assert data["device"]["torch"] and len(data["rows"]) == 2
    row = data["rows"][0]
    assert (row["M"], row["N"], row["K"]) == (2, 64, 128)
    assert row["us"]["bf16"] > 0 and row["us"]["mxgemm"] > 0
    assert "| M | N | K |" in md.read_text()


def test_bad_shape_is_an_error(capsys):
    assert main(["bench", "--shapes", "2x64"]) == 2
    assert "MxNxK" in capsys.readouterr().out


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "mxgemm", "info"], capture_output=True, text=True, check=True)
    assert "backends" in out.stdout


def test_tune_writes_the_cache_and_a_second_run_profiles_nothing(capsys, monkeypatch, tmp_path):
    import os

    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("tunes the triton backend under the interpreter")
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    assert main(["tune", "--shapes", "3x64x256"]) == 0
    out = capsys.readouterr().out
    assert "triton" in out and "default µs" in out
    (path,) = tmp_path.glob("tuning-*.json")
    data = json.loads(path.read_text())
    assert data["metadata"]["gpu"] == "cpu" and len(data["entries"]) == 1
    (key,) = data["entries"]
    assert key.startswith("linear|triton|m4|n64|k256|bfloat16")
    assert main(["tune", "--shapes", "3x64x256"]) == 0
    assert "1 problems already tuned" in capsys.readouterr().out
    assert json.loads(path.read_text()) == data


def test_tune_moe_tunes_the_experts_by_rows_per_expert(capsys, monkeypatch, tmp_path):
    """`mxgemm tune --moe`: both projections of each model's experts, keyed by the rows per expert and the active
    experts of the token count's top-k copies, and gate/up's tactic in the routed block under its own key; a second
    run finds them in the file."""
    import os

    import pytest

    from mxgemm import bench_moe, cli

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("tunes the triton backend's grouped weights under the interpreter")
    from mxgemm import autotune

    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "TUNING_ROUTINGS", 2)  # each tactic on 2 routings, not 8: the interpreter is slow
    tiny = {"tiny-moe": (4, 64, 32, 2)}  # experts, hidden, width, top-k
    monkeypatch.setattr(bench_moe, "MOE_MODELS", tiny)
    monkeypatch.setattr(cli, "MOE_MODELS", tiny)
    assert main(["tune", "--moe", "tiny-moe", "--m", "3"]) == 0
    assert "tokens" in capsys.readouterr().out
    (path,) = tmp_path.glob("tuning-*.json")
    keys = sorted(json.loads(path.read_text())["entries"])
    assert [k.split("|")[:5] for k in keys] == [
        ["experts", "triton", "m2", "n64", "k64"],
        ["grouped", "triton", "m2", "n64", "k32"],
        ["grouped", "triton", "m2", "n64", "k64"],
    ]
    assert all(k.endswith(",experts:4,active:4|w8a8-block") for k in keys)  # 3 tokens of top-2: 6 rows
    assert main(["tune", "--moe", "tiny-moe", "--m", "3"]) == 0
    assert "3 problems already tuned" in capsys.readouterr().out
    # what the file records (the default too, where nothing beat it) is a tactic the backend offers: a fresh tuner
    # follows it
    from mxgemm.autotune import Autotuner
    from mxgemm.backends import get_backend

    weight = mxgemm.prepare_grouped_weight(*bench_moe.random_experts(4, 64, 64, seed=128, device=torch.device("cpu")))
    tuner = Autotuner.for_device(mxgemm.describe_device())
    tactic, source = tuner.grouped_choice(get_backend("triton"), weight, 6, torch.bfloat16)
    assert source == "cache" and tactic in get_backend("triton").grouped_tactics(2, weight)
    tactic, source = tuner.grouped_choice(get_backend("triton"), weight, 6, torch.bfloat16, op="experts")
    assert source == "cache" and tactic in get_backend("triton").grouped_tactics(2, weight)


def test_info_prints_reasons_verbatim(capsys, monkeypatch):
    """Reasons hold brackets (pip extras): the table must not eat them as markup."""
    from helpers import hide_package

    hide_package(monkeypatch, "flashinfer")
    assert main(["info"]) == 0
    assert "pip install 'mxgemm[flashinfer]'" in capsys.readouterr().out.replace("\n", "")


def test_tune_model_dir_tunes_the_models_linear_shapes(capsys, monkeypatch, tmp_path):
    """`mxgemm tune --model-dir`: the distinct shapes of the model's linear layers (built on the meta device from its
    config alone), lm_head left out, then of their q/k/v and gate/up groups' joined weights."""
    import os

    import pytest

    transformers = pytest.importorskip("transformers")
    from mxgemm.models import linear_shapes

    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        architectures=["LlamaForCausalLM"],
    )
    cfg.save_pretrained(tmp_path / "model")  # config.json only: no weights needed
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    shapes = linear_shapes(model)
    assert [(n, k) for n, k, _ in shapes] == [(64, 64), (32, 64), (128, 64), (64, 128), (256, 64)]  # q/k/v: 128 x 64
    assert shapes[0][2] == "model.layers.0.self_attn.q_proj"
    assert shapes[-1][2] == "model.layers.0.mlp: gate_proj, up_proj"
    assert linear_shapes(model, skip=())[4] == (96, 64, "lm_head")
    assert (256, 64) not in [(n, k) for n, k, _ in linear_shapes(model, skip=("up_proj",))]  # up stays nn.Linear
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("tunes the triton backend under the interpreter")
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["tune", "--model-dir", str(tmp_path / "model"), "--m", "3"]) == 0
    assert "5 distinct linear shapes" in capsys.readouterr().out
    (path,) = (tmp_path / "cache").glob("tuning-*.json")
    keys = sorted(json.loads(path.read_text())["entries"])
    assert [k.split("|")[3:5] for k in keys] == [
        ["n128", "k64"],
        ["n256", "k64"],
        ["n32", "k64"],
        ["n64", "k128"],
        ["n64", "k64"],
    ]


def test_dot_scaled_runs_in_a_pass_of_its_own():
    """Every row gets dot_scaled's time (or None and the runner's note), after the rows were made."""
    from mxgemm.bench import BenchRow, _time_dot_scaled

    class Runner:
        def time(self, m, n, k):
            return (None, f"dot_scaled faulted at M={m}") if m == 2 else (float(m * n * k), "")

    rows = [BenchRow(1, 8, 16, "a", "triton", None), BenchRow(2, 8, 16, "b", "triton", None)]
    seen = []
    _time_dot_scaled(rows, Runner(), seen.append)
    assert [r.us["dot_scaled"] for r in rows] == [128.0, None]
    assert rows[0].notes == [] and rows[1].notes == ["dot_scaled faulted at M=2"]
    assert seen == ["dot_scaled M=1 N=8 K=16", "dot_scaled M=2 N=8 K=16"]


def test_version_bare_command_and_defaults_in_help(capsys):
    import pytest

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"mxgemm {mxgemm.__version__}"
    assert main([]) == 0  # bare: the help, not an error
    assert "{info,bench,quantize,tune}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: MXFP8)" in text and "(default: lm_head)" in text and "(default: 5GB)" in text


def _model_dir(tmp_path):
    from helpers import tiny_llama_folder

    return tiny_llama_folder(tmp_path / "model")


def test_quantize_mistakes_are_one_line_before_anything_is_written(tmp_path, capsys):
    """A size without a unit (5 would be 5 bytes: hundreds of shards), an infinite size, a --skip pattern that
    matches nothing, a CUDA device this torch has not, float64 weights: one line each, and no output folder."""
    src = _model_dir(tmp_path)
    cases = {
        ("--max-shard-size", "5"): "give a size with its unit",
        ("--max-shard-size", "inf"): "give a size with its unit",
        ("--max-shard-size", "infGB"): "must be a finite size",
        ("--skip", "lm_head", "nothing_like_this*"): "skip pattern 'nothing_like_this*' matches no linear layer",
    }
    if not torch.cuda.is_available():
        cases["--device", "cuda"] = "sees no CUDA GPU; use --device cpu"
    from helpers import tiny_llama_folder

    f64 = tiny_llama_folder(tmp_path / "f64", dtype=torch.float64)
    assert main(["quantize", str(f64), str(tmp_path / "out")]) == 2
    said = capsys.readouterr().out
    assert "is stored as torch.float64; mxgemm quantizes float32, bfloat16 or float16 weights" in said, said
    assert "Traceback" not in said and not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    for args, message in cases.items():
        assert main(["quantize", str(src), str(tmp_path / "out"), *args]) == 2
        out = capsys.readouterr().out
        assert message in out and "Traceback" not in out and len(out.strip().splitlines()) == 1, out
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_the_output_follows_the_umask(tmp_path):
    """The checkpoint is written in a private staging folder, then moved into place with the umask's mode."""
    import os
    import stat

    src = _model_dir(tmp_path)
    old = os.umask(0o022)
    try:
        assert main(["quantize", str(src), str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755


def test_debug_shows_the_traceback(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="no model folder"):
        main(["--debug", "quantize", str(tmp_path / "missing"), str(tmp_path / "out")])


def test_bench_on_cpu_says_it_ignores_the_gpu_shape_sets(capsys):
    import pytest

    if torch.cuda.is_available():
        pytest.skip("on a GPU --model runs its shape sets")
    assert main(["bench", "--model", "llama3-70b", "--baselines"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--model and --m choose GPU shape sets: ignored here" in out and "no CUDA GPU" in out


def test_bench_moe_cpu_smoke(tmp_path, capsys, monkeypatch):
    """``bench --moe`` on a CPU: tiny experts through auto's grouped backend (the emulation, without the
    interpreter) against bf16 torch._grouped_mm, both projections and the whole block (against transformers' experts
    module), each row's output checked against bf16's."""
    import pytest

    if torch.cuda.is_available():
        pytest.skip("on a GPU --moe times the models' experts")
    monkeypatch.delenv("TRITON_INTERPRET")
    path, md = tmp_path / "moe.json", tmp_path / "moe.md"
    assert main(["bench", "--moe", "deepseek-v3", "--json", str(path), "--markdown", str(md)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no CUDA GPU: timing tiny experts on CPU" in out and "the models and --m are ignored" in out
    data = json.loads(path.read_text())
    assert data["command"] == f"mxgemm bench --moe deepseek-v3 --json {path} --markdown {md}"
    rows = data["rows"]
    assert [(r["proj"], r["tokens"]) for r in rows] == [
        (p, t) for p in ("gate_up", "down", "block") for t in (1, 4, 16)
    ]
    for r in rows:
        assert r["backend"] == "emulation" and r["us"]["mxgemm"] > 0 and r["us"]["bf16"] > 0
        assert r["rel_err_vs_bf16"] < 1e-2  # w8a16: the dequantized experts, as bf16 multiplies them
    assert "| model | proj | tokens |" in md.read_text()
    with pytest.raises(SystemExit):
        main(["bench", "--moe", "llama3-8b"])  # not a mixture of experts: argparse names the choices
    assert "invalid choice: 'llama3-8b'" in capsys.readouterr().err


def test_cpu_bench_rows_show_no_empty_or_rate_columns_and_time_the_least_run():
    """A CPU run's table: no floor, rates or contenders without a value on any row (the 80-column terminal of a new
    user); a GPU run's screen table the narrow columns unless --wide; times the least of repeated runs, which other
    processes' time does not inflate."""
    import time

    from mxgemm.bench import BenchRow, table_rows
    from mxgemm.timing import time_cpu

    rows = [BenchRow(2, 64, 128, "custom", "emulation", None, us={"mxgemm": 100.0, "bf16": 10.0, "dot_scaled": None})]
    header, cells = table_rows(rows, smoke=True)
    assert header == ["M", "N", "K", "shape", "auto", "tactic", "mxgemm µs", "bf16 µs", "x bf16"]
    assert cells == [["2", "64", "128", "custom", "emulation", "default", "100.0", "10.0", "0.10"]]
    assert "TFLOP/s" in table_rows(rows)[0]  # a GPU run keeps its rates
    gpu = [BenchRow(64, 4096, 4096, "o", "hybrid_sm90", 6.7, us={"mxgemm": 10.0, "bf16": 15.0, "triton": 20.0})]
    narrow = ["M", "N", "K", "shape", "auto", "mxgemm µs", "bf16 µs", "x bf16", "% floor"]
    assert table_rows(gpu, wide=False)[0] == narrow
    assert {"tactic", "triton µs", "TFLOP/s", "GB/s"} <= set(table_rows(gpu)[0])  # --wide and the files
    delays = iter([0.03, 0.03, 0.03, 0.03])  # the warm-up and three runs slowed by a busy machine, then 1 ms each

    def call():
        time.sleep(next(delays, 0.001))

    assert time_cpu(call, repeats=5) < 10_000


def test_a_run_stopped_by_sigterm_leaves_nothing_and_the_next_removes_what_a_killed_one_left(tmp_path, capsys):
    """SIGTERM during quantize cleans the staging folder as Ctrl-C does. A staging folder whose process no longer
    exists (a run killed outright) is removed by the next run, which says so; one of a running process is left."""
    import os

    src = _model_dir(tmp_path)
    out = tmp_path / "out"
    script = (
        "import os, signal, time\n"
        "import mxgemm.convert\n"
        "def stopped(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(30)\n"
        "mxgemm.convert.quantize_folder = stopped\n"
        "from mxgemm.cli import main\n"
        f"raise SystemExit(main(['quantize', {str(src)!r}, {str(out)!r}]))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 130 and not out.exists() and not list(tmp_path.glob(".out.*")), run.stderr
    assert run.stdout.strip().endswith("interrupted") and "Traceback" not in run.stdout + run.stderr
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(gone.stdout), os.getppid()
    (tmp_path / f".out.{dead}.abc.tmp").mkdir()
    (tmp_path / f".out.{dead}.abc.tmp" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / f".out.{alive}.def.tmp").mkdir()
    assert main(["quantize", str(src), str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"removed .out.{dead}.abc.tmp, left beside the output by an interrupted run" in said
    assert not (tmp_path / f".out.{dead}.abc.tmp").exists() and (tmp_path / f".out.{alive}.def.tmp").is_dir()
    assert (out / "model.safetensors").is_file()


class _DeepGemmStandIn:
    """DeepGEMM's grouped API as documented at the commit the anchors carry (d374456): its argument checks, its
    alignment, and the product in fp32 (the real one needs an SM90 GPU)."""

    @staticmethod
    def get_m_alignment_for_contiguous_layout():
        return 128

    @staticmethod
    def get_col_major_tma_aligned_tensor(x):
        return x.transpose(-1, -2).contiguous().transpose(-1, -2)

    @staticmethod
    def _product(xq, xs, wq, ws):
        k = xq.shape[-1]
        x = xq.float() * xs.repeat_interleave(128, -1)[..., :k]
        w = wq.float() * ws.repeat_interleave(128, -2)[: wq.shape[0]].repeat_interleave(128, -1)[:, :k]
        return (x[:, None, :] * w[None]).sum(-1).bfloat16()  # each row's sums alike in any batch

    def m_grouped_gemm_fp8_fp8_bf16_nt_masked(self, lhs, rhs, out, masked_m, expected_m):
        (xq, xs), (wq, ws) = lhs, rhs
        g, m, k = xq.shape
        assert wq.shape[0] == g == out.shape[0] == masked_m.numel() and out.shape[1] == m and wq.shape[2] == k
        assert expected_m > 0 and xs.shape == (g, m, -(-k // 128)) and m % 4 == 0
        assert ws.shape == (g, -(-wq.shape[1] // 128), -(-k // 128)) and masked_m.dtype == torch.int32
        assert xq.dtype == wq.dtype == torch.float8_e4m3fn and out.dtype == torch.bfloat16
        for i in range(g):
            rows = int(masked_m[i])
            out[i, :rows] = self._product(xq[i, :rows], xs[i, :rows], wq[i], ws[i])

    def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(self, lhs, rhs, out, m_indices):
        (xq, xs), (wq, ws) = lhs, rhs
        m, k = xq.shape
        assert out.shape == (m, wq.shape[1]) and m_indices.numel() == m and m_indices.dtype == torch.int32
        assert xs.shape == (m, -(-k // 128)) and xq.is_contiguous() and out.is_contiguous()
        blocks = m_indices.view(-1, 128)  # every 128-row block of one group
        assert torch.equal(blocks, blocks[:, :1].expand_as(blocks))
        for i in range(m):
            g = int(m_indices[i])
            out[i] = self._product(xq[i : i + 1], xs[i : i + 1], wq[g], ws[g])[0]


def test_deepgemm_anchors_lay_out_the_same_routing_both_ways():
    """`mxgemm bench --moe`'s DeepGEMM columns, against a stand-in that holds DeepGEMM's documented argument checks:
    masked (each expert's rows in a slot) and contiguous (each expert's rows padded to 128) compute every expert's
    rows alike, empty experts included; experts that are not 128x128-block ones get no DeepGEMM column."""
    from mxgemm import bench_moe

    q, s = bench_moe.random_experts(4, 64, 256, seed=0, device=torch.device("cpu"))
    weight = mxgemm.prepare_grouped_weight(q, s, backend="triton")
    counts = [[3, 0, 130, 1], [0, 0, 0, 5]]
    calls = bench_moe.deepgemm_calls(weight, counts, 256, torch.device("cpu"), deep_gemm=_DeepGemmStandIn())
    assert set(calls) == {"deepgemm_masked", "deepgemm_contiguous"}
    for per_expert, masked, contiguous in zip(
        counts, calls["deepgemm_masked"], calls["deepgemm_contiguous"], strict=True
    ):
        masked()
        contiguous()
        out, flat = masked.args[2], contiguous.args[2]
        start = 0
        for i, c in enumerate(per_expert):
            assert torch.equal(out[i, :c], flat[start : start + c]) and (c == 0 or out[i, :c].abs().sum() > 0)
            start += -(-c // 128) * 128
        assert flat.shape[0] == start
    emulated = mxgemm.prepare_grouped_weight(q, s, backend="emulation", recipe="w8a16")
    assert bench_moe.deepgemm_calls(emulated, counts, 256, torch.device("cpu"), deep_gemm=_DeepGemmStandIn()) == {}


def test_deepgemm_kernels_are_built_once_each_before_the_timed_calls(monkeypatch):
    """`mxgemm bench --moe` builds the kernels DeepGEMM's JIT would compile one by one on first use: its own calls run
    on meta tensors while its tuner records each kernel's code (the stand-in below follows the anchors' d374456: the
    grouped calls hand ``jit_tuner.compile_and_tune`` their keys, and ``jit.build`` compiles a generated source);
    each distinct kernel is built once, a problem DeepGEMM refuses is skipped, and the tuner is left as it was."""
    import sys
    import types

    from mxgemm import bench_moe

    class Tuner:  # JITTuner: compile_and_tune a method of the class
        def compile_and_tune(self, **kwargs):
            raise AssertionError("DeepGEMM's own tuner builds one kernel at a time")

    built, tuner = [], Tuner()
    jit = types.ModuleType("deep_gemm.jit")
    jit.cpp_format = lambda template, keys: template.format(**keys)
    jit.generate = lambda includes, arg_defs, code: f"{includes}|{[a for a, _ in arg_defs]}|{code}"
    jit.build = lambda name, arg_defs, code: built.append((name, code))
    tuner_module = types.ModuleType("deep_gemm.jit_kernels.tuner")
    tuner_module.jit_tuner = tuner

    def grouped(kind, m_of):
        def call(lhs, rhs, out, layout, *hint):
            assert lhs[0].device.type == "meta" and rhs[0].dtype == torch.float8_e4m3fn
            m = m_of(lhs[0], hint)
            if kind == "contiguous" and m > 100_000:
                raise AssertionError("refused")  # as DeepGEMM's own argument checks do
            keys = {"N": rhs[0].shape[1], "K": rhs[0].shape[2], "BLOCK_M": 64 if m < 128 else 128, "KIND": kind}
            tuner.compile_and_tune(
                name="m_grouped_gemm_fp8_fp8_bf16_nt",
                keys=keys,
                space=(),
                includes=("deep_gemm/fp8_gemm.cuh",),
                arg_defs=(("lhs", torch.float8_e4m3fn), ("m", int)),
                template="{KIND} {N}x{K} {BLOCK_M}",
                args=(lhs, rhs, out, layout, *hint),
            )

        return call

    stand_in = _DeepGemmStandIn()
    stand_in.m_grouped_gemm_fp8_fp8_bf16_nt_masked = grouped("masked", lambda lhs, hint: hint[0])
    stand_in.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous = grouped("contiguous", lambda lhs, hint: lhs.shape[0])
    monkeypatch.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))
    monkeypatch.setitem(sys.modules, "deep_gemm.jit", jit)
    monkeypatch.setitem(sys.modules, "deep_gemm.jit_kernels", types.ModuleType("deep_gemm.jit_kernels"))
    monkeypatch.setitem(sys.modules, "deep_gemm.jit_kernels.tuner", tuner_module)
    problems = [(4, 256, 512, [3, 0, 130, 1]), (4, 256, 512, [3, 0, 130, 1]), (4, 256, 512, [1, 1, 1, 1])]
    problems += [(4, 256, 512, [200_000, 0, 0, 0])]  # refused by the contiguous call
    assert bench_moe.deepgemm_prebuild(problems, jobs=2, deep_gemm=stand_in) == 3
    # masked: 45 and 1 rows an active expert (64-row blocks), then 200000 (128); contiguous: 512 padded rows
    assert sorted(code.split("|")[-1] for _, code in built) == [
        "contiguous 256x512 128",
        "masked 256x512 128",
        "masked 256x512 64",
    ]
    assert "compile_and_tune" not in vars(tuner)  # the class's method again
