"""The command line runs and says what it should."""

import json
import subprocess
import sys

from mxgemm.cli import main


def test_info(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "emulation" in out and "triton" in out and "auto" in out
    assert "needs a CUDA GPU" in out or "Triton kernel on" in out
    assert "torch" in out


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


def test_info_prints_reasons_verbatim(capsys, monkeypatch):
    """Reasons hold brackets (pip extras): the table must not eat them as markup."""
    from helpers import hide_package

    hide_package(monkeypatch, "flashinfer")
    assert main(["info"]) == 0
    assert "pip install 'mxgemm[flashinfer]'" in capsys.readouterr().out.replace("\n", "")
