"""Nothing on disk is trusted: cache folders other users could change are not loaded from, lock files are not opened
through links, tuning files that are not regular files are ignored, a model folder's links and shard names never lead
out of it, and a checkpoint written into a folder is the only one read from it afterwards."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_kernel_builds import SYMBOL, _builds, toolkit  # noqa: F401 (a fixture)

import mxgemm
from mxgemm import autotune, cache, tuning
from mxgemm.checkpoints import CheckpointError, TensorSource, load_checkpoint, save_checkpoint, source_files
from mxgemm.cli import main
from mxgemm.device import describe_device
from mxgemm.kernels import nvcc

ROOT = os.getuid() == 0


# --- cache folders -----------------------------------------------------------------------------------------------


def test_a_private_folder_is_made_owner_only(tmp_path):
    folder = cache.private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o757, 0o775])
def test_a_folder_others_can_write_is_refused(tmp_path, mode):
    """Writable by others, or by a group other than this user's own private one."""
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(mode)
    if mode == 0o775:
        if not ROOT:
            pytest.skip("giving a folder to another group needs root")
        os.chown(folder, -1, 4242)
    with pytest.raises(cache.UnsafeFolderError, match="writable by other users"):
        cache.private_dir(folder)


def test_a_folder_writable_by_this_users_own_group_is_kept(tmp_path):
    """Under a umask of 002 a user's folders are writable by the user's private group, which holds no one else."""
    if not cache._own_private_group(os.getgid()):
        pytest.skip("this user has no private group")
    folder = tmp_path / "mine"
    folder.mkdir()
    folder.chmod(0o775)
    assert cache.private_dir(folder) == folder


def test_a_link_in_place_of_the_folder_is_refused(tmp_path):
    real = cache.private_dir(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(cache.UnsafeFolderError, match="symbolic link"):
        cache.private_dir(tmp_path / "link")


def test_a_folder_under_one_others_can_change_is_refused(tmp_path):
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    open_parent.chmod(0o777)  # no sticky bit: anyone could rename our folder away and put theirs in its place
    with pytest.raises(cache.UnsafeFolderError, match="which other users can change"):
        cache.private_dir(open_parent / "mine")
    open_parent.chmod(0o1777)  # as /tmp: only the owner may rename
    assert cache.private_dir(open_parent / "mine").is_dir()


@pytest.mark.skipif(not ROOT, reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_is_refused(tmp_path):
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    os.chown(folder, 4242, 4242)
    with pytest.raises(cache.UnsafeFolderError, match="owned by user 4242"):
        cache.private_dir(folder)


def test_the_lock_is_not_opened_through_a_planted_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    folder = cache.private_dir(tmp_path / "cache")
    (folder / "lib.so.lock").symlink_to(victim)
    with pytest.raises(OSError), cache.locked(folder / "lib.so"):
        pass
    assert victim.read_text() == "precious"


def _plant(folder: Path, name: str) -> None:
    """Another user's library, with the checksum the loader checks, where a build of ``name`` would be."""
    folder.mkdir(parents=True, exist_ok=True)
    planted = folder / name
    planted.write_bytes(Path(sys.modules["_ctypes"].__file__).read_bytes())
    planted.with_name(name + ".sha256").write_text(nvcc._sha256(planted))


def test_a_planted_library_in_a_shared_cache_is_never_loaded(toolkit, tmp_path, monkeypatch):  # noqa: F811
    """A cache folder other users can write (here: world-writable) may hold anything: mxgemm neither loads nor
    writes there, says why, and builds in this user's private folder instead."""
    source, log = toolkit
    shared = tmp_path / "shared-cache"
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(shared))
    _, _, name = nvcc._build_key(source, (9, 0), "")
    _plant(shared / "kernels", name)
    (shared / "kernels").chmod(0o777)
    lib = nvcc.build(source, (9, 0), symbols=[SYMBOL])
    assert Path(lib._name).parent == tmp_path / "tmp" / f"mxgemm-{os.getuid()}" / "kernels"
    assert _builds(log) == 1  # built anew, not taken from the shared folder


def test_a_planted_temporary_folder_is_not_used(toolkit, tmp_path, monkeypatch):  # noqa: F811
    """The folder under the temporary directory that builds fall back to has a predictable name: one made by someone
    else (here: open to everyone) is refused, and the build fails with the reason instead of loading what it
    holds."""
    source, log = toolkit
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(blocked))
    _, _, name = nvcc._build_key(source, (9, 0), "")
    folder = tmp_path / "tmp" / f"mxgemm-{os.getuid()}" / "kernels"
    _plant(folder, name)
    folder.chmod(0o777)
    with pytest.raises(RuntimeError, match=r"no folder to build .* writable by other users"):
        nvcc.build(source, (9, 0), symbols=[SYMBOL])
    assert _builds(log) == 0


# --- the fast-call extension's cache -----------------------------------------------------------------------------


def test_a_killed_build_and_a_truncated_library_heal(tmp_path):
    """A build killed while it held torch's build lock leaves that lock behind, and a library cut short crashes the
    process that imports it (SIGBUS): a new process removes the stale lock, sees the library fail its recorded
    checksum, rebuilds it and runs."""
    from mxgemm import fastcall

    if not fastcall.status():
        pytest.skip(fastcall.status().reason)
    library = Path(fastcall.extension().__file__)
    folder = library.parent
    (folder / "lock").write_text("")  # torch's FileBaton of a build that never finished
    data = library.read_bytes()
    library.unlink()  # a new file in its place: this process keeps the one it mapped
    library.write_bytes(data[: len(data) // 3])
    env = dict(os.environ, MXGEMM_CACHE_DIR=str(folder.parent.parent))
    script = "from mxgemm import fastcall; assert fastcall.status(), fastcall.status().reason; print('ran')"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ran" in done.stdout, done.stderr[-2000:]
    assert library.read_bytes() != data[: len(data) // 3] and not (folder / "lock").exists()


# --- tuning files -----------------------------------------------------------------------------------------------


def _hostile(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "not utf-8":
        path.write_bytes(b'{"metadata": "\xff\xfe"}')
    elif kind == "deeply nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    elif kind == "link":
        secret = path.with_name("secret.json")
        secret.write_text(json.dumps({"metadata": {}, "entries": {}}))
        path.symlink_to(secret)


@pytest.mark.parametrize("kind", ["fifo", "not utf-8", "deeply nested", "link"])
def test_a_hostile_tuning_file_is_ignored_with_a_warning(tmp_path, kind, caplog):
    """The guarantee (docs/guide.md): a broken tuning file is ignored with a warning, and every call still runs."""
    path = tuning.default_cache_path(describe_device())
    path.parent.mkdir(parents=True, exist_ok=True)
    _hostile(path, kind)
    tuner = autotune.Autotuner.for_device()
    assert tuner.cache.entries == {} and tuner.cache.status.startswith("not used: unreadable")
    assert "ignoring unreadable tuning file" in caplog.text
    w = mxgemm.prepare_weight(*_mx(64, 64), backend="emulation")
    assert mxgemm.linear(torch.randn(3, 64, dtype=torch.bfloat16), w).shape == (3, 64)


def _mx(n, k):
    t = mxgemm.quantize(torch.randn(n, k))
    return t.qdata, t.scale


def test_a_tuning_file_in_a_folder_others_can_write_is_not_read(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(shared))
    path = tuning.default_cache_path(describe_device())
    shared.mkdir()
    path.write_text(json.dumps({"metadata": tuning.environment_metadata(describe_device()), "entries": {}}))
    shared.chmod(0o777)
    cache_ = tuning.TuningCache(path, tuning.environment_metadata(describe_device()))
    assert "writable by other users" in cache_.status
    cache_.put({"k": {"tactic": None}})
    assert "not written" in cache_.status


# --- model folders ----------------------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path):
    pytest.importorskip("transformers")
    from helpers import tiny_llama_folder

    return tiny_llama_folder(tmp_path / "model")


@pytest.mark.parametrize("target", ["secret", "device", "parent"])
def test_quantize_refuses_links_that_lead_out_of_the_model_folder(model_dir, tmp_path, capsys, target):
    """A link to a file outside (a secret), to a device (copies until the disk is full) or to the parent folder
    (recursion) is refused in one line, and no output is left behind."""
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    (model_dir / "tokenizer.json").symlink_to({"secret": secret, "device": "/dev/zero", "parent": tmp_path}[target])
    out = tmp_path / "out"
    assert main(["quantize", str(model_dir), str(out)]) == 2
    said = capsys.readouterr().out
    assert "tokenizer.json" in said and ("leads out of the model folder" in said or "link to a folder" in said)
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_a_hugging_face_cache_snapshot_is_read_through_its_links(model_dir, tmp_path):
    """Hugging Face's cache keeps files in ``blobs/`` and links to them from ``snapshots/<revision>/``: the links
    stay inside the repository's folder, so they are read (and side files copied as files)."""
    repo = tmp_path / "models--x--y"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (model_dir / "tokenizer.json").write_text("{}")
    for f in model_dir.iterdir():
        blob = repo / "blobs" / f"hash-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    assert [p.name for p in source_files(snapshot)] == ["model.safetensors"]
    out = tmp_path / "out"
    assert main(["quantize", str(snapshot), str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and not (out / "tokenizer.json").is_symlink()


@pytest.mark.parametrize("name", ["../other/model.safetensors", "/etc/passwd", "", 7, "sub/../x.safetensors"])
def test_an_index_naming_a_file_outside_the_folder_is_refused(model_dir, tmp_path, name):
    other = tmp_path / "other"
    other.mkdir()
    save_file({"x": torch.zeros(2)}, str(other / "model.safetensors"))
    index = {"metadata": {}, "weight_map": {"x": name}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file name of the folder"):
        TensorSource(model_dir)


def test_a_shard_that_is_a_fifo_is_refused_without_blocking(model_dir):
    os.mkfifo(model_dir / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="not a regular file"):
        TensorSource(model_dir)


# --- old data taken for new -------------------------------------------------------------------------------------


def test_save_checkpoint_replaces_an_older_sharded_checkpoint(model_dir, tmp_path):
    """An older sharded checkpoint in the folder (its index and shards) goes: the weights read back are the new."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "ckpt"
    old = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    old.save_pretrained(out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    mxgemm.quantize_model(model, backend="emulation", fuse=False)
    save_checkpoint(model, out, config=model.config.to_dict())
    assert sorted(p.name for p in out.glob("*.safetensors*")) == ["model.safetensors"]
    stored = load_file(str(out / "model.safetensors"))
    assert torch.equal(stored["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    fresh = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    load_checkpoint(fresh, out, backend="emulation", fuse=False)
    assert torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)


def _tiny_moe(tmp_path) -> Path:
    pytest.importorskip("transformers")
    from helpers import tiny_qwen3_moe

    tiny_qwen3_moe().save_pretrained(tmp_path / "moe")
    return tmp_path / "moe"


@pytest.mark.parametrize("skip_experts", [False, True])
def test_quantize_of_a_moe_model_claims_only_what_it_quantized(tmp_path, capsys, skip_experts):
    """The experts are quantized per expert, as other producers store them; the routers stay in bf16 and are named
    in ``ignore``, as are experts left out (here by ``--skip``): a reader of ``targets: ["Linear"]`` (vLLM) must not
    take bf16 bytes for FP8."""
    src = _tiny_moe(tmp_path)
    out = tmp_path / "out"
    skip = ["--skip", "lm_head", "*.experts"] if skip_experts else []
    assert main(["quantize", str(src), str(out), *skip]) == 0
    said = capsys.readouterr().out
    assert f"{0 if skip_experts else 2} of 2 experts modules" in said
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    stored = load_file(str(out / "model.safetensors"))
    source = load_file(str(src / "model.safetensors"))
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp"
        assert f"{prefix}.gate" in q["ignore"] and f"{prefix}.gate.weight_scale" not in stored
        assert (f"{prefix}.experts" in q["ignore"]) is skip_experts
        for e in range(4):
            for p in ("gate_proj", "up_proj", "down_proj"):
                weight = stored[f"{prefix}.experts.{e}.{p}.weight"]
                if skip_experts:
                    assert weight.dtype == torch.bfloat16 and f"{prefix}.experts.{e}.{p}.weight_scale" not in stored
                    continue
                ref = mxgemm.quantize(source[f"{prefix}.experts.{e}.{p}.weight"])
                assert torch.equal(weight.view(torch.uint8), ref.qdata.view(torch.uint8))
                assert torch.equal(stored[f"{prefix}.experts.{e}.{p}.weight_scale"], ref.scale)
        assert stored[f"model.layers.{layer}.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert "lm_head" in q["ignore"] and not any("embed_tokens" in n or "norm" in n for n in q["ignore"])


def test_save_checkpoint_of_a_moe_model_names_what_it_left_in_ignore(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(_tiny_moe(tmp_path))
    mxgemm.quantize_model(model, backend="emulation", fuse=False, experts=False)  # the experts stay in bf16
    save_checkpoint(model, tmp_path / "out", config=model.config.to_dict())
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert {"model.layers.0.mlp.experts", "model.layers.0.mlp.gate", "lm_head"} <= set(q["ignore"])
    assert not any("q_proj" in n for n in q["ignore"])


# --- silent wrong results ---------------------------------------------------------------------------------------


def test_skip_given_as_one_string_is_one_pattern():
    model = torch.nn.Sequential()
    model.add_module("lm_head", torch.nn.Linear(64, 64))
    model.add_module("h", torch.nn.Linear(64, 64))
    report = mxgemm.quantize_model(model, backend="emulation", skip="lm_head", fuse=False)
    assert type(model.lm_head) is torch.nn.Linear and isinstance(model.h, mxgemm.MXFP8Linear)
    assert [r.name for r in report.skipped] == ["lm_head"]


@pytest.mark.parametrize("backend", ["emulation", "triton"])
def test_a_strided_bias_is_added_as_given(backend):
    """``longer[::2]`` is added element by element, on every backend (the Triton kernel reads a bias at unit
    stride: the call hands it a contiguous copy)."""
    from helpers import skip_unless_backend_runs

    skip_unless_backend_runs(backend)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = mxgemm.prepare_weight(*(t.to(device) for t in _mx(32, 64)), backend=backend)
    x = torch.randn(2, 64, dtype=torch.bfloat16, device=device)
    longer = torch.randn(64, dtype=torch.bfloat16, device=device)
    strided = mxgemm.linear(x, w, longer[::2])
    assert torch.equal(strided, mxgemm.linear(x, w, longer[::2].contiguous()))
    assert not torch.equal(strided, mxgemm.linear(x, w, longer[:32]))


def test_a_cache_dir_with_a_tilde_is_the_home_folder(monkeypatch, tmp_path):
    from mxgemm import settings

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MXGEMM_CACHE_DIR", "~/mx-cache")
    assert settings.cache_dir() == tmp_path / "mx-cache"


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.uint8, "float32"])
def test_dequantize_refuses_a_dtype_that_is_not_floating_point(dtype):
    with pytest.raises(TypeError, match="not a floating-point dtype"):
        mxgemm.dequantize(mxgemm.quantize(torch.randn(2, 32)), dtype)


def test_missing_parents_are_made_owner_only_too(tmp_path):
    """Every folder made on the way is mode 0700 whatever the umask, so that a umask of 002 leaves none of them
    group-writable."""
    old = os.umask(0o002)
    try:
        cache.private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    assert [stat.S_IMODE((tmp_path / p).stat().st_mode) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
