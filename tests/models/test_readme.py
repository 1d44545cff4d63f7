"""The README's examples run as written and print what it shows: each ```python and ```bash block in order, in one
folder holding a tiny Qwen3-MoE saved as ``my-model``, on a CPU (no GPU visible, no Triton interpreter), where every
layer runs on the emulation reference. A ```text block after an example holds lines its output must contain. The
vLLM example runs in vLLM's environment of its own (``tests/models/test_vllm_plugin.py``, with :func:`examples`)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torchao")

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def examples(vllm: bool = False) -> list[tuple[str, str, list[str]]]:
    """(language, code, expected lines) of each runnable block of the Ways in section, in order: those that import
    vLLM (``vllm``), or the others."""
    section = README.read_text().split("## Ways in", 1)[1].split("\n## ", 1)[0]
    blocks = [(m.group(1), m.group(2)) for m in BLOCK.finditer(section)]
    out = []
    for i, (lang, code) in enumerate(blocks):
        if lang in ("python", "bash") and ("from vllm" in code) == vllm:
            after = blocks[i + 1] if i + 1 < len(blocks) else ("", "")
            expected = [line for line in after[1].splitlines() if line.strip()] if after[0] == "text" else []
            out.append((lang, code, expected))
    return out


def test_the_ways_in_are_runnable_examples_and_the_readme_is_a_front_door():
    assert [lang for lang, _, _ in examples()] == ["python", "bash", "python", "python", "python"]
    assert [lang for lang, _, _ in examples(vllm=True)] == ["python"]
    assert all(expected for _, _, expected in examples() + examples(vllm=True))
    assert len(README.read_text().splitlines()) <= 150


def test_every_example_runs_and_prints_what_the_readme_shows(tmp_path):
    from helpers import tiny_qwen3_moe

    tiny_qwen3_moe(2).save_pretrained(tmp_path / "my-model")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MXGEMM_", "TRITON_INTERPRET"))}
    env.update(CUDA_VISIBLE_DEVICES="", MXGEMM_CACHE_DIR=str(tmp_path / "cache"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the mxgemm command
    for lang, code, expected in examples():
        cmd = [sys.executable, "-c", code] if lang == "python" else [shutil.which("bash") or "bash", "-c", code]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{code}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        lines = [line.rstrip() for line in done.stdout.splitlines()]
        for line in expected:
            assert any(line.rstrip() in got for got in lines), f"{code}\nexpected {line!r} in:\n{done.stdout}"
