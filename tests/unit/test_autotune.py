"""The autotuner with a fake tunable backend whose tactics have known costs and known failures."""

import itertools
import json
import logging
import multiprocessing as mp
from collections import Counter
from typing import ClassVar

import pytest
import torch
from helpers import random_mx_weight

import mxgemm
from mxgemm import autotune, tuning
from mxgemm.autotune import Autotuner
from mxgemm.backends.emulation import EmulationBackend
from mxgemm.ops import linear_op
from mxgemm.tuning import TuneKey, TuningCache, bucket

META = {"mxgemm": "test", "torch": "x", "triton": None, "cuda": None, "gpu": "pretend", "sm": 90}


class FakeTunable(EmulationBackend):
    """Tactics with known costs (µs); one always fails; one is within the margin of the default."""

    name = "fake_tunable"
    tunable = True
    COSTS: ClassVar[dict] = {"default": 10.0, "fast": 6.0, "broken": None, "near": 9.9, "also_fast": 6.0}

    def __init__(self):
        self.calls = []

    def tactics(self, m, weight):
        return [{"name": n} for n in self.COSTS]

    def run(self, x, weight, bias, tactic=None):
        self._charge(tactic, lambda name: name)
        return super().run(x, weight, bias)

    def _charge(self, tactic, call) -> None:
        """Record ``call(name)`` of the tactic, then keep its cost for the timer or, a broken one, fail."""
        name = (tactic or {"name": "default"})["name"]
        self.calls.append(call(name))
        if self.COSTS[name] is None:
            raise RuntimeError("invalid config for this bucket")
        self.last_cost = self.COSTS[name]


def _tuner(tmp_path, backend, meta=META, **kw):
    return Autotuner(TuningCache(tmp_path / "tuning.json", meta), timer=lambda fn: (fn(), backend.last_cost)[1], **kw)


@pytest.fixture
def weight():
    q, s = random_mx_weight(64, 128)
    return mxgemm.prepare_weight(q, s, backend="emulation")


def test_buckets_map_up():
    assert [bucket(m) for m in (1, 3, 16, 17, 4000, 5000, 100000)] == [1, 4, 16, 32, 4096, 8192, 16384]


def test_best_valid_tactic_chosen_failures_counted(tmp_path, weight):
    b = FakeTunable()
    result = _tuner(tmp_path, b).tune(b, weight, 9, torch.bfloat16)
    assert result.tactic == {"name": "fast"}  # first of the two equally fast ones: a stable tie-break
    assert result.failed == 1 and result.timed == 5
    assert result.default_us == 10.0 and result.best_us == 6.0 and result.key.m_bucket == 16
    record = json.loads((tmp_path / "tuning.json").read_text())["entries"][str(result.key)]
    assert record == {"tactic": {"name": "fast"}, "us": 6.0, "default_us": 10.0, "failed": 1}


def test_a_tactic_within_the_margin_keeps_the_default(tmp_path, weight, monkeypatch):
    monkeypatch.setattr(FakeTunable, "COSTS", {"default": 10.0, "near": 9.9, "broken": None})
    b = FakeTunable()
    assert _tuner(tmp_path, b).tune(b, weight, 4, torch.bfloat16).tactic == {"name": "default"}


def test_a_win_must_hold_in_a_second_timing(tmp_path, weight, monkeypatch):
    """The default reads slow once (as the first tactic timed can on a GPU); a tactic that beats only that reading
    is not chosen, one that beats the default in both timings is, and the recorded times are the second ones."""
    monkeypatch.setattr(FakeTunable, "COSTS", {"default": 10.0, "near": 9.8, "broken": None})
    b = FakeTunable()
    readings = {"default": [13.0]}  # the first timing of the default only

    def timer(fn):
        fn()
        name = b.calls[-1]
        return readings[name].pop(0) if readings.get(name) else b.COSTS[name]

    tuner = Autotuner(TuningCache(tmp_path / "tuning.json", META), timer=timer)
    result = tuner.tune(b, weight, 4, torch.bfloat16)
    assert result.tactic == {"name": "default"} and result.default_us == 10.0 and result.best_us == 10.0
    monkeypatch.setattr(FakeTunable, "COSTS", {"default": 10.0, "fast": 6.0})
    readings["default"] = [13.0]
    result = tuner.tune(b, weight, 8, torch.bfloat16)
    assert result.tactic == {"name": "fast"} and result.default_us == 10.0 and result.best_us == 6.0


def test_warm_restart_times_nothing_and_buckets_share_entries(tmp_path, weight):
    b = FakeTunable()
    _tuner(tmp_path, b).tune(b, weight, 16, torch.bfloat16)

    def no_timing(fn):
        raise AssertionError("a warm restart must not time anything")

    warm = Autotuner(TuningCache(tmp_path / "tuning.json", META), timer=no_timing)
    for m in (9, 12, 16):
        assert warm.lookup(b, weight, m, torch.bfloat16) == {"name": "fast"}
    assert warm.lookup(b, weight, 17, torch.bfloat16) is None  # another bucket: the default
    assert warm.lookup(b, weight, 16, torch.float16) is None  # another dtype: another key


def test_metadata_mismatch_is_not_used_nor_overwritten(tmp_path, weight, caplog):
    b = FakeTunable()
    _tuner(tmp_path, b).tune(b, weight, 16, torch.bfloat16)
    before = (tmp_path / "tuning.json").read_text()
    other = dict(META, torch="9.9")
    with caplog.at_level(logging.WARNING, logger="mxgemm"):
        tuner = _tuner(tmp_path, b, meta=other)
    assert "not used, not overwritten" in caplog.text
    assert tuner.lookup(b, weight, 16, torch.bfloat16) is None
    tuner.tune(b, weight, 16, torch.bfloat16)
    assert (tmp_path / "tuning.json").read_text() == before


def test_a_file_without_an_environment_record_is_not_used(tmp_path, weight, caplog):
    """Entries with no record of the environment they were timed in are not followed: they may come from any GPU."""
    b = FakeTunable()
    _tuner(tmp_path, b).tune(b, weight, 16, torch.bfloat16)
    data = json.loads((tmp_path / "tuning.json").read_text())
    del data["metadata"]
    (tmp_path / "tuning.json").write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="mxgemm"):
        tuner = _tuner(tmp_path, b)
    assert "no environment record" in tuner.cache.status and "not used, not overwritten" in caplog.text
    assert tuner.lookup(b, weight, 16, torch.bfloat16) is None


def test_untunable_backend_is_never_timed(tmp_path, weight):
    def no_timing(fn):
        raise AssertionError("emulation has no tactics")

    tuner = Autotuner(TuningCache(tmp_path / "t.json", META), timer=no_timing)
    emulation = mxgemm.backends.get_backend("emulation")
    assert tuner.tune(emulation, weight, 16, torch.bfloat16) is None
    assert tuner.lookup(emulation, weight, 16, torch.bfloat16) is None
    assert not (tmp_path / "t.json").exists()


def test_never_tunes_during_graph_capture(tmp_path, weight, monkeypatch):
    monkeypatch.setattr(autotune, "_capturing", lambda: True)
    b = FakeTunable()
    assert _tuner(tmp_path, b).tune(b, weight, 16, torch.bfloat16) is None and b.calls == []


def _writer(path, prefix, count):
    cache = TuningCache(path, META)
    for i in range(count):
        cache.put({f"{prefix}{i}": {"tactic": {"i": i}, "us": 1.0, "default_us": 1.0, "failed": 0}})


def test_concurrent_writers_leave_a_valid_file(tmp_path):
    path = tmp_path / "shared.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(path, p, 30)) for p in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 60 and {k[0] for k in entries} == {"a", "b"}


def test_key_names_everything_that_matters(weight):
    key = TuneKey.of("triton", weight, 20, torch.float16)
    assert str(key) == "linear|triton|m32|n64|k128|float16|qdata:float8_e4m3fn,scale:uint8|w8a16"


def test_hot_path_lookup_and_opt_in_tuning(weight, monkeypatch):
    """Lookups by default; tuning on a miss only with MXGEMM_AUTOTUNE=1, read when a call's plan is made (a layer
    whose plan for this M exists keeps it until tuning changes the cache), through the op as eagerly."""
    from mxgemm.backends import _REGISTRY

    b = FakeTunable()
    monkeypatch.setitem(_REGISTRY, b.name, b)
    w = mxgemm.PreparedWeight(b.name, weight.recipe, 64, 128, weight.tensors, {})
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(autotune, "_TUNERS", {})
    mxgemm.linear(x, w)
    assert b.calls == ["default"]
    monkeypatch.setenv("MXGEMM_AUTOTUNE", "1")
    tuner = autotune.tuner_for(x.device)
    tuner.timer = lambda fn: (fn(), b.last_cost)[1]
    b.calls.clear()
    mxgemm.linear(x, w)
    assert b.calls == ["default"]  # the plan made before
    w.plans.clear()
    mxgemm.linear(x, w)
    assert b.calls[1:6] == ["default", "fast", "broken", "near", "also_fast"] and b.calls[-1] == "fast"
    b.calls.clear()
    mxgemm.linear(x, w)  # tuned now: straight to the chosen tactic
    assert b.calls == ["fast"]
    b.calls.clear()
    linear_op(x, w.op_tensors, None, w.backend, w.op_meta)  # the op, as compiled graphs call it: the same tactic
    assert b.calls == ["fast"]


def test_choice_names_its_source_user_cache_before_shipped_file(tmp_path, weight):
    b = FakeTunable()
    shipped = TuningCache(tmp_path / "shipped.json", META)
    shipped.put({str(TuneKey.of(b.name, weight, 4, torch.bfloat16)): {"tactic": {"name": "near"}}})
    shipped.put({str(TuneKey.of(b.name, weight, 64, torch.bfloat16)): {"tactic": {"name": "near"}}})
    tuner = Autotuner(TuningCache(tmp_path / "user.json", META), shipped=shipped, timer=_tuner(tmp_path, b).timer)
    tuner.tune(b, weight, 4, torch.bfloat16)
    assert tuner.choice(b, weight, 3, torch.bfloat16) == ({"name": "fast"}, "cache")
    assert tuner.choice(b, weight, 50, torch.bfloat16) == ({"name": "near"}, "shipped")
    assert tuner.choice(b, weight, 200, torch.bfloat16) == (None, "default")


def _hybrid_weight(n: int, k: int, info: dict) -> mxgemm.PreparedWeight:
    """A hybrid_sm90 weight's shapes without its values (nothing is run)."""
    padded = (-(-n // 16) * 16, -(-k // 512) * 512)
    tensors = {"qdata": torch.empty(padded, dtype=torch.uint8), "block_scale": torch.empty(0)}
    return mxgemm.PreparedWeight("hybrid_sm90", "hybrid-block128", n, k, tensors, info)


def test_hybrid_triton_configs_are_valid_block_scaled_tiles():
    from mxgemm.backends.base import Tactic
    from mxgemm.backends.hybrid_sm90 import HybridSM90Backend, Path

    b = HybridSM90Backend()
    for n, k, crossover in ((4096, 14336, 96), (6144, 4096, 48), (28672, 4096, 1)):
        w = _hybrid_weight(n, k, {"crossover": crossover})
        for m in (1, 16, 64, 256, 4096):
            tactics = b.tactics(m, w)
            if m >= crossover:
                assert tactics == [Tactic(Path.CUBLAS)]
                continue
            configs = [t.config for t in tactics if t.path == Path.TRITON]
            assert len(configs) > 3 and len(configs) == len(set(configs)) and tactics[0].config == configs[0]
            for c in configs:  # block-scaled tiles: 128 deep, a width dividing 128, whole K blocks per split
                assert c.bk == 128 and 128 % c.bn == 0 and k >= c.split_k * c.bk and c.valid(k, block_scaled=True)


def test_hybrid_fp8_tactics_share_the_quantized_regime():
    """Where our FP8 kernel is built: from the crossover up to M = 256 its configs join cuBLASLt's tactic (first up to
    M = 64, and up to M = 128 while its CTAs fit one wave), every config valid for the weight, none twice; above M = 256
    cuBLASLt alone; below the crossover none."""
    from mxgemm.backends.base import Tactic
    from mxgemm.backends.hybrid_sm90 import HybridSM90Backend, Path, fp8_default
    from mxgemm.kernels import fp8_gemm

    b = HybridSM90Backend()
    for (n, k), crossover in itertools.product(((4096, 14336), (130, 96), (57344, 8192)), (1, 48)):
        w = _hybrid_weight(n, k, {"crossover": crossover, "small_m": True, "fp8_sms": 132})
        np_, kp = w.tensors["qdata"].shape
        assert crossover == 1 or not any(t.path.quantized for t in b.tactics(crossover - 1, w))
        for m in (1, 5, 16, 48, 64, 100, 256)[0 if crossover == 1 else 3 :]:
            tactics = b.tactics(m, w)
            one_wave = m <= 128 and n <= 8448  # 132 SMs: up to 132 CTAs of 64 weight rows
            assert Tactic(Path.CUBLAS) in tactics and tactics[0].path == (Path.FP8 if m <= 64 or one_wave else "cublas")
            configs = [t.config for t in tactics if t.path == Path.FP8]
            assert configs[0] == fp8_default(m, np_, kp, 132) and len(configs) > 8
            assert {c.tn for c in configs} == (
                {min(t for t in fp8_gemm.TOKEN_TILES if t >= m)} if m <= 64 else {64, 128}
            )
            assert len(configs) == len(set(configs)) and all(c.valid(kp) for c in configs)
        assert b.tactics(257, w) == [Tactic(Path.CUBLAS)]


def test_shipped_h200_file_is_found_and_names_tactics_the_backends_offer():
    """The tuning file in the package: found for an H200, tuned on these kernels (their digest), and each entry a
    tactic its backend offers for its bucket."""
    from mxgemm.backends.base import tactic_json
    from mxgemm.device import DeviceInfo
    from mxgemm.kernels import source_digest
    from mxgemm.recipes import hybrid_crossover

    h200 = DeviceInfo(type="cuda", name="NVIDIA H200", capability=(9, 0), index=0)
    data = json.loads(tuning.shipped_cache_path(h200).read_text())
    assert data["metadata"]["gpu"] == "NVIDIA H200" and data["metadata"]["sm"] == 90
    assert data["metadata"]["kernels"] == source_digest(), "the shipped tuning file was made on other kernels"
    assert len(data["entries"]) >= 225  # the llama3-8b, llama3-70b, hidden-7168 and llama3-8b-hf sets: 15 shapes x 15
    shapes = {tuple(key.split("|")[3:5]) for key in data["entries"]}
    assert {("n1024", "k4096"), ("n14336", "k4096"), ("n128256", "k4096")} <= shapes  # Hugging Face's own layers
    for key, record in data["entries"].items():
        op, backend, m, n, k, *_ = key.split("|")
        assert op == "linear" and backend == "hybrid_sm90", key
        m, n, k = int(m[1:]), int(n[1:]), int(k[1:])
        b = mxgemm.backends.get_backend(backend)
        w = _hybrid_weight(n, k, {"crossover": hybrid_crossover(n, k, fp8=True), "small_m": True, "fp8_sms": 132})
        assert record["tactic"] in [tactic_json(t) for t in b.tactics(m, w)], key
        assert record["us"] <= record["default_us"] and record["failed"] == 0


def test_shipped_h100_file_holds_grouped_tactics_the_backend_offers(monkeypatch):
    """The H100 file in the package (`mxgemm tune --moe`): found for an H100 80GB HBM3, tuned on these kernels, its
    entries the grouped keys of the three bench models' projections and the experts keys of their routed blocks at
    1-4096 tokens, each a tactic the triton backend offers on SM90 for its bucket."""
    from types import SimpleNamespace

    from mxgemm import thresholds
    from mxgemm.backends import triton_w8a16
    from mxgemm.backends.base import recorded_as
    from mxgemm.device import DeviceInfo
    from mxgemm.kernels import source_digest

    h100 = DeviceInfo(type="cuda", name="NVIDIA H100 80GB HBM3", capability=(9, 0), index=0)
    data = json.loads(tuning.shipped_cache_path(h100).read_text())
    assert data["metadata"]["gpu"] == h100.name and data["metadata"]["kernels"] == source_digest()
    ops = Counter(key.split("|")[0] for key in data["entries"])
    assert ops == {"grouped": 42, "experts": 21}  # 3 models x (2 projections, the block) x 7 token counts
    monkeypatch.setattr(triton_w8a16, "_wgmma_runs", lambda device: True)
    monkeypatch.setattr(thresholds, "for_device", lambda device: thresholds.SM90)  # an H100's, on a CPU
    b = mxgemm.backends.get_backend("triton")
    for key, record in data["entries"].items():
        _, backend, m, _, k, dtype, layout, recipe = key.split("|")
        assert (backend, dtype, recipe) == ("triton", "bfloat16", "w8a8-block"), key
        experts = int(layout.split("experts:")[1].split(",")[0])
        weight = SimpleNamespace(experts=experts, device=torch.device("cuda", 0), in_features=int(k[1:]))
        assert any(recorded_as(t, record["tactic"]) for t in b.grouped_tactics(int(m[1:]), weight)), key
        assert record["us"] <= record["default_us"] and record["failed"] == 0


def test_a_record_made_before_a_config_field_was_added_is_its_default():
    """A tuning file written before ``WgmmaConfig.persistent`` existed names the launch that field's default keeps,
    and no other; a record of another value or kind names nothing offered."""
    from mxgemm.backends.base import Tactic, recorded_as
    from mxgemm.kernels.grouped.wgmma import WgmmaConfig

    old = {"path": "wgmma", "config": {"kind": "WgmmaConfig", "stages": 4, "tn": 128, "wn": 128}}
    assert recorded_as(Tactic("wgmma", WgmmaConfig(128, 128, 4)), old)
    assert not recorded_as(Tactic("wgmma", WgmmaConfig(128, 128, 4, persistent=True)), old)
    assert not recorded_as(Tactic("wgmma", WgmmaConfig(64, 128, 4)), old)
    assert not recorded_as(Tactic("grouped", WgmmaConfig(128, 128, 4)), old)
    assert not recorded_as(Tactic("wgmma", WgmmaConfig(128, 128, 4)), {**old, "config": {**old["config"], "kind": "X"}})
    assert recorded_as("plain", "plain") and not recorded_as(Tactic("wgmma", WgmmaConfig()), "plain")


@pytest.mark.parametrize(
    "content",
    [
        "[1, 2, 3]",  # valid JSON, not a tuning file
        '{"metadata": META, "entries": [1, 2]}',
        '{"metadata": META, "entries": {"KEY": 5, "other": {"us": 1}}}',  # entries of the wrong type
        '{"metadata": META, "entries": {"KEY": {"tactic": {"name": "gone", "XX": 1}}}}',  # a tactic it does not have
        '{"metadata": META, "entries": {"KEY": {"tactic": 7}}}',
    ],
)
def test_a_bad_tuning_file_never_breaks_a_call(tmp_path, weight, monkeypatch, caplog, content):
    """Malformed files and entries are ignored with a warning naming the file; the call runs its default."""
    from mxgemm.backends import _REGISTRY

    b = FakeTunable()
    monkeypatch.setitem(_REGISTRY, b.name, b)
    w = mxgemm.PreparedWeight(b.name, weight.recipe, 64, 128, weight.tensors, {})
    key = str(TuneKey.of(b.name, w, 3, torch.bfloat16))
    text = content.replace("META", json.dumps(META)).replace("KEY", key.replace('"', '\\"'))
    path = tmp_path / "tuning.json"
    path.write_text(text)
    monkeypatch.setattr(autotune, "_TUNERS", {("cpu", None): Autotuner(TuningCache(path, META))})
    with caplog.at_level(logging.WARNING, logger="mxgemm"):
        y = mxgemm.linear(torch.randn(3, 128, dtype=torch.bfloat16), w)
    assert y.shape == (3, 64) and b.calls == ["default"]
    assert str(path) in caplog.text


@pytest.mark.parametrize("where", ["a_file", "other_version"])
def test_tuning_that_cannot_be_saved_still_runs_once(tmp_path, weight, monkeypatch, caplog, where):
    """A cache path that is a file, or a file of another environment: MXGEMM_AUTOTUNE=1 tunes once, keeps the
    choice in memory and never raises inside the call."""
    from mxgemm.backends import _REGISTRY

    b = FakeTunable()
    monkeypatch.setitem(_REGISTRY, b.name, b)
    w = mxgemm.PreparedWeight(b.name, weight.recipe, 64, 128, weight.tensors, {})
    if where == "a_file":
        (tmp_path / "blocker").write_text("x")
        path = tmp_path / "blocker" / "tuning.json"
    else:
        path = tmp_path / "tuning.json"
        path.write_text(json.dumps({"metadata": dict(META, torch="0.1"), "entries": {}}))
    before = path.read_text() if path.exists() else None
    tuner = Autotuner(TuningCache(path, META), timer=lambda fn: (fn(), b.last_cost)[1])
    monkeypatch.setattr(autotune, "_TUNERS", {("cpu", None): tuner})
    monkeypatch.setenv("MXGEMM_AUTOTUNE", "1")
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="mxgemm"):
        mxgemm.linear(x, w)
    assert b.calls[-1] == "fast" and b.calls.count("default") >= 1
    b.calls.clear()
    w.plans.clear()
    mxgemm.linear(x, w)  # a new plan looks the tactic up again: tuned already, in memory
    assert b.calls == ["fast"]
    assert (path.read_text() if path.exists() else None) == before


def test_tuning_files_record_the_kernels_they_were_timed_on(tmp_path):
    """The environment record holds a digest of the kernels' code: a comment, a docstring or blank space added leaves
    it; one changed token of a CUDA source or of a Python kernel gives another digest, so a file tuned on other
    kernels is not used."""
    import shutil
    from pathlib import Path

    from mxgemm import kernels

    meta = tuning.environment_metadata(mxgemm.describe_device("cpu"))
    assert meta["kernels"] == kernels.source_digest() and len(meta["kernels"]) == 16
    copy = tmp_path / "kernels"
    shutil.copytree(Path(kernels.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert kernels.source_digest(copy) == kernels.source_digest()
    source, binding = copy / "csrc" / "small_m.cu", copy / "small_m.py"
    cuda, python = source.read_text(), binding.read_text()
    source.write_text("// a comment\n/* and a\n   block */\n" + cuda + "\n\n   \n")
    binding.write_text(python.replace('"""', '"""Another docstring. ', 1) + "\n# a comment\n")
    kernels.source_digest.cache_clear()
    assert kernels.source_digest(copy) == kernels.source_digest()
    for path, code in ((source, cuda + "\nint mxgemm_unused;\n"), (binding, python + "\nUNUSED = 1\n")):
        original = path.read_text()
        path.write_text(code)
        kernels.source_digest.cache_clear()
        assert kernels.source_digest(copy) != kernels.source_digest(), path.name
        path.write_text(original)


def test_the_kernels_digest_reads_the_same_on_every_python():
    """Python 3.12's syntax trees add ``type_params`` (empty) to every function, where ``ast.dump`` writes it and 3.11
    has no such field: the digest's text of a tree leaves out the fields that are None or empty, so the shipped tuning
    files' record (made on one Python) names the same kernels on another; a field with a value still counts."""
    import ast

    from mxgemm.kernels import _tree_text

    tree = ast.parse("def f(x: int = 1) -> int:\n    return x + 1\n")
    before = _tree_text(tree)
    function = tree.body[0]
    function._fields = (*function._fields, "added")
    function.added = []
    assert _tree_text(tree) == before
    function.added = [ast.Name("T")]
    assert _tree_text(tree) != before


def test_the_kernels_digest_is_the_same_under_every_python_found_here():
    """The shipped files' record is made under the device's Python: every other Python found here (pyenv's, 3.10 on)
    computes this one's digest of these kernels (the digest needs no torch: a stub stands in for its import)."""
    import subprocess
    from pathlib import Path

    from mxgemm import kernels

    found = [
        python
        for python in sorted(Path.home().glob(".pyenv/versions/3.*/bin/python3"))
        if tuple(int(part) for part in python.parts[-3].split(".")[:2]) >= (3, 10)
    ]
    if not found:
        pytest.skip("no other Python found (pyenv's versions)")
    code = (
        "import runpy, sys, types; from pathlib import Path; sys.modules['torch'] = types.ModuleType('torch'); "
        "print(runpy.run_path(sys.argv[1])['source_digest'](Path(sys.argv[1]).parent))"
    )
    for python in found:
        run = subprocess.run([python, "-c", code, kernels.__file__], capture_output=True, text=True, timeout=120)
        assert run.stdout.strip() == kernels.source_digest(), (str(python), run.stderr[-500:])


def test_each_environment_keeps_its_own_file_and_says_how_each_file_is_used(tmp_path, monkeypatch, caplog):
    """The user's file is named by the environment's record, so an upgrade (other versions or kernels) writes a file of
    its own instead of finding one it may neither use nor overwrite; each file says whether it is used, and why not."""
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    device = mxgemm.describe_device("cpu")
    here = tuning.default_cache_path(device)
    assert here.parent == tmp_path and here.name.startswith("tuning-cpu-")
    assert here == tuning.default_cache_path(device)
    meta = tuning.environment_metadata(device)
    monkeypatch.setattr(tuning, "environment_metadata", lambda d: dict(meta, kernels="0" * 16))
    assert tuning.default_cache_path(device) != here
    cache = TuningCache(here, meta)
    assert cache.describe() == f"{here}: absent (tuning writes it: `mxgemm tune`, or calls with MXGEMM_AUTOTUNE=1)"
    cache.put({"k": {"tactic": None}})
    assert TuningCache(here, meta).describe() == f"{here}: 1 entries"
    with caplog.at_level(logging.WARNING, logger="mxgemm"):
        other = TuningCache(here, dict(meta, torch="9.9", kernels="f" * 16))
    assert (
        other.describe() == f"{here}: not used: made for kernels {meta['kernels']} (here {'f' * 16}), torch "
        f"{meta['torch']} (here 9.9)"
    )
    here.write_text("[1]")
    assert TuningCache(here, meta).describe().endswith("not used: not a tuning file")
    here.write_text("{")
    assert "not used: unreadable" in TuningCache(here, meta).describe()


class FakeGroupedTunable(FakeTunable):
    """Grouped tactics with known costs (µs), on the emulation's grouped twin."""

    name = "fake_grouped_tunable"
    COSTS: ClassVar[dict] = {"default": 10.0, "fast": 6.0, "broken": None}

    def grouped_tactics(self, per_expert, weight, active=None):
        return [{"name": n} for n in self.COSTS]

    def run_grouped(self, x, weight, offsets, tactic=None):
        self._charge(tactic, lambda name: (name, x.shape[0], offsets.tolist()))
        return super().run_grouped(x, weight, offsets)


@pytest.fixture
def grouped():
    pairs = [random_mx_weight(64, 128, seed=i) for i in range(4)]
    q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    return mxgemm.prepare_grouped_weight(q, s, backend="emulation", recipe="w8a8-block")


def test_grouped_weights_are_tuned_by_rows_per_expert_and_active_experts_on_routed_rows(tmp_path, grouped):
    """The key buckets the rows per expert and the active experts of an even spread and names the expert count;
    each tactic is timed on a round of routings of those buckets' rows, drawn at random over that many experts; the
    choice is recorded and read back from the file. Fewer rows than experts: so many rows as the bucket holds, each to
    an expert at random, which experts changing from routing to routing."""
    b = FakeGroupedTunable()
    tuner = _tuner(tmp_path, b)
    result = tuner.tune_grouped(b, grouped, 9, torch.bfloat16)  # 9 rows over 4 experts: 3 an expert -> bucket 4
    assert result.tactic == {"name": "fast"} and result.failed == 1 and result.key.m_bucket == 4
    assert str(result.key).startswith("grouped|fake_grouped_tunable|m4|n64|k128|bfloat16|")
    assert str(result.key).endswith(",experts:4,active:4|w8a8-block")
    timed = {(rows, tuple(offs)) for _, rows, offs in b.calls}
    assert {rows for rows, _ in timed} == {16} and {offs[-1] for _, offs in timed} == {16}
    assert {offs for _, offs in timed} == {tuple(o.tolist()) for o in autotune.tuning_routings(4, 4, 4, "cpu")}
    assert len(timed) > 1 and (4, 8, 12, 16) not in {offs for _, offs in timed}  # uneven, and not one routing
    fresh = Autotuner(TuningCache(tmp_path / "tuning.json", META))
    assert fresh.grouped_choice(b, grouped, 13, torch.bfloat16) == ({"name": "fast"}, "cache")
    assert fresh.grouped_choice(b, grouped, 17, torch.bfloat16) == (None, "default")  # 5 an expert: bucket 8
    assert fresh.choice(b, grouped, 4, torch.bfloat16) == (None, "default")  # a dense key is another problem
    assert fresh.grouped_choice(b, grouped, 2, torch.bfloat16) == (None, "default")  # 2 rows: 2 active, not 4

    b.calls.clear()
    result = tuner.tune_grouped(b, grouped, 2, torch.bfloat16)  # 2 rows over the 4 experts
    assert result.key.m_bucket == 1 and str(result.key).endswith(",experts:4,active:2|w8a8-block")
    counts = {tuple(torch.diff(torch.tensor(offs), prepend=torch.zeros(1)).tolist()) for _, _, offs in b.calls}
    assert all(sum(c) == 2 for c in counts) and len(counts) > 1
    again = Autotuner(TuningCache(tmp_path / "tuning.json", META))
    assert again.grouped_choice(b, grouped, 2, torch.bfloat16) == ({"name": "fast"}, "cache")
    assert again.grouped_choice(b, grouped, 3, torch.bfloat16) == (None, "default")  # 3 active: bucket 4


def test_tuning_routings_spread_rows_as_a_router_does():
    """Qwen3-30B-A3B's buckets: at 16 rows an expert every expert active, the rows uneven across experts (a token
    tile of 16 rows no longer holds every expert's rows) and the same from one call to the next; at one row an
    expert over all 128 experts (16 tokens of top-8) about 81 experts read, some for several rows, as a router's
    (bench --moe's 16-token routings read 82.1); at 8 rows other experts in each routing of the round (so that a round
    reads more weights than one routing's)."""
    prefill = autotune.tuning_routings(16, 128, 128, "cpu")
    counts = [torch.diff(o, prepend=o.new_zeros(1)) for o in prefill]
    assert len(prefill) == autotune.TUNING_ROUTINGS and all(int(o[-1]) == 2048 for o in prefill)
    assert all(int(c.min()) >= 0 and int(c.max()) > 16 for c in counts)
    assert all(torch.equal(a, b) for a, b in zip(prefill, autotune.tuning_routings(16, 128, 128, "cpu"), strict=True))
    assert len({tuple(o.tolist()) for o in prefill}) == len(prefill)
    sixteen = [torch.diff(o, prepend=o.new_zeros(1)) for o in autotune.tuning_routings(1, 128, 128, "cpu")]
    assert all(int(c.sum()) == 128 and 70 <= int((c > 0).sum()) <= 92 and int(c.max()) >= 2 for c in sixteen)
    decode = [torch.diff(o, prepend=o.new_zeros(1)) for o in autotune.tuning_routings(1, 8, 128, "cpu")]
    assert all(int(c.sum()) == 8 and int((c > 0).sum()) >= 6 for c in decode)
    assert len(set().union(*(set(torch.nonzero(c).flatten().tolist()) for c in decode))) > 32
    one_token = [torch.diff(o, prepend=o.new_zeros(1)) for o in autotune.tuning_routings(1, 8, 128, "cpu", topk=8)]
    assert all(sorted(c.tolist())[-9:] == [0] + [1] * 8 for c in one_token)  # a token's top-8: 8 distinct experts
    mixtral = [torch.diff(o, prepend=o.new_zeros(1)) for o in autotune.tuning_routings(1, 2, 8, "cpu", topk=2)]
    assert (
        all(sorted(c.tolist()) == [0] * 6 + [1, 1] for c in mixtral) and len({tuple(c.tolist()) for c in mixtral}) > 1
    )
    odd = autotune.tuning_routings(1, 8, 8, "cpu", topk=3)  # 8 rows of the bucket: 2 tokens' top-3 copies
    assert all(int(o[-1]) == 6 for o in odd)


def test_a_routed_blocks_projection_is_tuned_on_its_tokens_top_k_copies(tmp_path, grouped):
    """With ``topk`` (``tune --moe``, a routed block's down on a miss) the projection's tactics are timed on the
    top-k copies of tokens, and the choice is recorded under the same key as without."""
    b = FakeGroupedTunable()
    result = _tuner(tmp_path, b).tune_grouped(b, grouped, 2, torch.bfloat16, topk=2)  # one token of top-2
    assert str(result.key).endswith(",experts:4,active:2|w8a8-block")
    timed = {tuple(torch.diff(torch.tensor(offs), prepend=torch.zeros(1)).tolist()) for _, _, offs in b.calls}
    assert timed == {
        tuple(torch.diff(o, prepend=o.new_zeros(1)).tolist()) for o in autotune.tuning_routings(1, 2, 4, "cpu", topk=2)
    }
    assert all(sorted(c) == [0, 0, 1, 1] for c in timed) and len(timed) > 1


def test_grouped_calls_take_the_tuned_tactic_of_each_projection(tmp_path, grouped, monkeypatch):
    """``grouped_linear`` and ``moe_experts`` look their tactics up above the backend (tuning on a miss only with
    MXGEMM_AUTOTUNE=1) and hand them down: the block's two projections each their own."""
    from mxgemm.backends import _REGISTRY

    b = FakeGroupedTunable()
    monkeypatch.setitem(_REGISTRY, b.name, b)
    monkeypatch.setattr(autotune, "_TUNERS", {})
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    w = mxgemm.PreparedGroupedWeight(b.name, grouped.recipe, 64, 128, grouped.tensors, {}, experts=4)
    x, offsets = torch.randn(6, 128, dtype=torch.bfloat16), torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    mxgemm.grouped_linear(x, w, offsets)
    assert [c[0] for c in b.calls] == ["default"]
    monkeypatch.setenv("MXGEMM_AUTOTUNE", "1")
    autotune.tuner_for(x.device).timer = lambda fn: (fn(), b.last_cost)[1]
    b.calls.clear()
    y = mxgemm.grouped_linear(x, w, offsets)
    r = autotune.TUNING_ROUTINGS  # each tactic timed on a round of routings, the broken one failing at once
    tuned = ["default"] * r + ["fast"] * r + ["broken"] + ["default"] * r + ["fast"] * r
    assert [c[0] for c in b.calls] == [*tuned, "fast"]  # tuned, then run
    assert torch.equal(y, b.run_grouped(x, w, offsets))

    pairs = [random_mx_weight(128, 32, seed=10 + i) for i in range(4)]
    dq, ds = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    down_tensors = mxgemm.prepare_grouped_weight(dq, ds, backend="emulation", recipe="w8a8-block").tensors
    down = mxgemm.PreparedGroupedWeight(b.name, grouped.recipe, 128, 32, down_tensors, {}, experts=4)
    picked = []

    def run_experts(self, x, ids, weights, gate_up, down, tactics):
        picked.append(tactics)
        return x.clone()

    monkeypatch.setattr(FakeGroupedTunable, "run_experts", run_experts)
    autotune.tuner_for(x.device).tune_grouped(b, down, 6, torch.bfloat16)  # down on its rows
    monkeypatch.delenv("MXGEMM_AUTOTUNE")  # and no entry of the block's own: gate/up's projection's
    ids, weights = torch.tensor([[0, 2], [2, 3], [1, 2]]), torch.full((3, 2), 0.5, dtype=torch.bfloat16)
    mxgemm.moe_experts(torch.randn(3, 128, dtype=torch.bfloat16), ids, weights, w, down)
    assert picked == [({"name": "fast"}, {"name": "fast"})]


class FakeBlockTunable(FakeGroupedTunable):
    """The fake grouped tactics with other costs in the routed block: "fast" alone, slow in the block."""

    name = "fake_block_tunable"
    BLOCK_COSTS: ClassVar[dict] = {"default": 10.0, "fast": 12.0, "broken": None}

    def run_experts(self, x, topk_ids, topk_weights, gate_up, down, tactics=(None, None)):
        name = (tactics[0] or {"name": "default"})["name"]
        self.calls.append(("block", name, tuple(topk_ids.shape), tactics[1] and tactics[1]["name"]))
        if self.BLOCK_COSTS[name] is None:
            raise RuntimeError("invalid config for this bucket")
        self.last_cost = self.BLOCK_COSTS[name]
        return x.clone()


def test_the_blocks_gate_up_tactic_is_timed_on_the_whole_block_and_taken_before_the_projections(
    tmp_path, grouped, monkeypatch
):
    """tune_experts times each gate/up tactic on the routed block (down on its recorded choice, top-k routings of the
    key's buckets from a fixed seed, distinct experts a token) and records it under its own key; ``moe_experts``
    takes that entry before the projection's, which the block does not run as it was timed."""
    from mxgemm.backends import _REGISTRY

    b = FakeBlockTunable()
    monkeypatch.setitem(_REGISTRY, b.name, b)
    monkeypatch.setattr(autotune, "_TUNERS", {})
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    w = mxgemm.PreparedGroupedWeight(b.name, grouped.recipe, 64, 128, grouped.tensors, {}, experts=4)
    pairs = [random_mx_weight(128, 32, seed=10 + i) for i in range(4)]
    dq, ds = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    down_tensors = mxgemm.prepare_grouped_weight(dq, ds, backend="emulation", recipe="w8a8-block").tensors
    down = mxgemm.PreparedGroupedWeight(b.name, grouped.recipe, 128, 32, down_tensors, {}, experts=4)
    tuner = autotune.tuner_for(torch.device("cpu"))
    tuner.timer = lambda fn: (fn(), b.last_cost)[1]
    assert tuner.tune_grouped(b, w, 6, torch.bfloat16).tactic == {"name": "fast"}  # alone, "fast" wins
    assert tuner.tune_grouped(b, down, 6, torch.bfloat16).tactic == {"name": "fast"}
    b.calls.clear()
    result = tuner.tune_experts(b, w, down, 3, 2, torch.bfloat16)  # 6 copies over 4 experts: 2 an expert, 4 tokens
    assert result.tactic == {"name": "default"} and result.failed == 1
    assert str(result.key).startswith("experts|fake_block_tunable|m2|n64|k128|bfloat16|")
    assert {c[1:] for c in b.calls} == {(n, (4, 2), "fast") for n in ("default", "fast", "broken")}
    routings = autotune.tuning_top_k(4, 2, 4, "cpu", torch.bfloat16)
    assert len(routings) == autotune.TUNING_ROUTINGS and len({tuple(i.flatten().tolist()) for i, _ in routings}) > 1
    assert all(int(i[t, 0]) != int(i[t, 1]) for i, _ in routings for t in range(4))
    assert tuner.grouped_choice(b, w, 6, torch.bfloat16, op="experts") == ({"name": "default"}, "cache")
    no_entry = tuner.grouped_choice(b, down, 6, torch.bfloat16, op="experts")  # no block entry of that weight
    assert no_entry == (None, "default")

    b.calls.clear()
    ids, weights = torch.tensor([[0, 2], [2, 3], [1, 2]]), torch.full((3, 2), 0.5, dtype=torch.bfloat16)
    mxgemm.moe_experts(torch.randn(3, 128, dtype=torch.bfloat16), ids, weights, w, down)
    assert b.calls == [("block", "default", (3, 2), "fast")]
