"""The kernel build cache heals: a stand-in nvcc (a script that "builds" by copying a real shared library) shows
builds verified before use, rebuilt when bad, a timeout on the compiler, read-only caches usable, and errors that
say why instead of escaping as crashes."""

import _ctypes
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from mxgemm.cache import cache_folders
from mxgemm.kernels import nvcc

SYMBOL = "PyInit__ctypes"  # what the stand-in library exports


@pytest.fixture
def toolkit(tmp_path, monkeypatch):
    """A CUDA_HOME whose bin/nvcc copies Python's _ctypes extension to -o; each build appends to builds.log."""
    root = tmp_path / "cuda"
    (root / "bin").mkdir(parents=True)
    log = tmp_path / "builds.log"
    script = root / "bin" / "nvcc"
    script.write_text(f"""#!{sys.executable}
import os, shutil, sys, time
if "--version" in sys.argv:
    print("stand-in nvcc 1.0")
    sys.exit(0)
if os.environ.get("STANDIN_NVCC_HANG"):
    time.sleep(30)
with open({str(log)!r}, "a") as f:
    f.write("build\\n")
shutil.copy({_ctypes.__file__!r}, sys.argv[sys.argv.index("-o") + 1])
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CUDA_HOME", str(root))
    monkeypatch.setattr(nvcc.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    source = tmp_path / "kernel.cu"
    source.write_text("// a kernel\n")
    return source, log


def _builds(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_built_once_then_loaded(toolkit):
    source, log = toolkit
    assert hasattr(nvcc.build(source, (9, 0), symbols=[SYMBOL]), SYMBOL)
    assert hasattr(nvcc.build(source, (9, 0), symbols=[SYMBOL]), SYMBOL)
    assert _builds(log) == 1


@pytest.mark.parametrize("damage", [lambda b: b[: len(b) // 3], lambda b: b"\x7fELF garbage" * 100])
def test_a_bad_library_is_rebuilt_not_loaded(toolkit, damage):
    """A truncated or garbage file in the cache would crash the process if loaded: it fails the recorded checksum
    and is rebuilt."""
    source, log = toolkit
    compiler, flags, name = nvcc._build_key(source, (9, 0), "")
    path = cache_folders("kernels")[0] / name
    path.parent.mkdir(parents=True)
    nvcc._compile(compiler, flags, source, path)  # built by an earlier process, not loaded in this one
    path.write_bytes(damage(path.read_bytes()))
    assert hasattr(nvcc.build(source, (9, 0), symbols=[SYMBOL]), SYMBOL)
    assert _builds(log) == 2


def test_a_library_without_its_symbols_is_an_error_with_a_reason(toolkit):
    source, _ = toolkit
    with pytest.raises(RuntimeError, match="lacks mxgemm_missing"):
        nvcc.build(source, (9, 0), symbols=["mxgemm_missing"])


def test_a_hanging_compiler_times_out(toolkit, monkeypatch):
    source, _ = toolkit
    monkeypatch.setenv("STANDIN_NVCC_HANG", "1")
    monkeypatch.setattr(nvcc, "BUILD_TIMEOUT_S", 1)
    with pytest.raises(RuntimeError, match="did not finish in 1 s"):
        nvcc.build(source, (9, 0), symbols=[SYMBOL])


def test_a_read_only_cache_serves_its_builds_and_new_ones_go_elsewhere(toolkit, monkeypatch, tmp_path):
    source, log = toolkit
    built = Path(nvcc.build(source, (9, 0), symbols=[SYMBOL])._name)

    real_locked = nvcc.locked

    def read_only_cache(path):  # the cache folder cannot be written; the temporary one can
        if path.parent == built.parent:
            raise PermissionError(13, "Read-only file system")
        return real_locked(path)

    monkeypatch.setattr(nvcc, "locked", read_only_cache)
    assert Path(nvcc.build(source, (9, 0), symbols=[SYMBOL])._name) == built  # no lock needed to load
    other = Path(nvcc.build(source, (10, 0), symbols=[SYMBOL])._name)  # a new build: the temporary folder
    assert other.parent == tmp_path / "tmp" / f"mxgemm-{os.getuid()}" / "kernels" and _builds(log) == 2


def test_the_cache_key_covers_the_compiler_and_architecture(toolkit, monkeypatch, tmp_path):
    source, log = toolkit
    a = Path(nvcc.build(source, (9, 0), symbols=[SYMBOL])._name).name
    b = Path(nvcc.build(source, (9, 0), suffix="a", symbols=[SYMBOL])._name).name
    other = tmp_path / "cuda2"
    shutil.copytree(Path(nvcc.find_nvcc()).parent, other / "bin")  # another toolkit with the same version
    monkeypatch.setenv("CUDA_HOME", str(other))
    c = Path(nvcc.build(source, (9, 0), symbols=[SYMBOL])._name).name
    source.write_text("// a changed kernel\n")
    d = Path(nvcc.build(source, (9, 0), symbols=[SYMBOL])._name).name
    assert len({a, b, c, d}) == 4 and _builds(log) == 4


def test_include_dirs_are_flags_and_part_of_the_key(toolkit, tmp_path):
    source, _ = toolkit
    _, plain, name = nvcc._build_key(source, (9, 0), "")
    _, flags, other = nvcc._build_key(source, (9, 0), "", [tmp_path / "include"])
    assert f"-I{tmp_path / 'include'}" in flags and f"-I{tmp_path / 'include'}" not in plain and name != other
    assert hasattr(nvcc.build(source, (9, 0), symbols=[SYMBOL], include_dirs=[tmp_path / "include"]), SYMBOL)


def test_cublaslt_header_is_found_beside_nvcc_or_in_the_cublas_wheel(toolkit, tmp_path, monkeypatch):
    """Planned cuBLASLt calls build against cublasLt.h: the toolkit's, or the nvidia-cublas wheel's; without one they
    are unavailable with that reason (and hybrid_sm90 runs torch._scaled_mm)."""
    import importlib.util
    from types import SimpleNamespace

    from mxgemm.kernels import cublaslt

    wheel = tmp_path / "site" / "nvidia"
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: SimpleNamespace(submodule_search_locations=[str(wheel)])
    )
    assert cublaslt.header_dir() is None
    for folder in (wheel / "cublas" / "include", wheel / "cu13" / "include", tmp_path / "cuda" / "include"):
        folder.mkdir(parents=True)
        (folder / "cublasLt.h").write_text("// header\n")
        assert cublaslt.header_dir() == folder  # the toolkit's first, then a cu* folder, then cublas/
    cublaslt._library.cache_clear()
    try:
        (tmp_path / "cuda" / "include" / "cublasLt.h").unlink()
        (wheel / "cu13" / "include" / "cublasLt.h").unlink()
        (wheel / "cublas" / "include" / "cublasLt.h").unlink()
        with pytest.raises(RuntimeError, match=r"cublasLt\.h was not found"):
            cublaslt._library()
    finally:
        cublaslt._library.cache_clear()


def test_a_header_beside_the_source_is_part_of_the_key(toolkit):
    """A change to a header the sources include (csrc/*.cuh) builds anew: the key covers the headers."""
    source, _ = toolkit
    _, _, before = nvcc._build_key(source, (9, 0), "")
    (source.parent / "shared.cuh").write_text("// a header\n")
    _, _, after = nvcc._build_key(source, (9, 0), "")
    (source.parent / "shared.cuh").write_text("// a header, changed\n")
    _, _, changed = nvcc._build_key(source, (9, 0), "")
    assert len({before, after, changed}) == 3
