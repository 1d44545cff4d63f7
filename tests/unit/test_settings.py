"""Environment variables: parsed in one place, bad values refused with the variable's name and what it accepts."""

import pytest
from helpers import random_mx_weight

from mxgemm import settings
from mxgemm.backends.hybrid_sm90 import HybridSM90Backend


@pytest.mark.parametrize(
    "value,expected",
    [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" on ", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("", False),
    ],
)
def test_autotune_switch(monkeypatch, value, expected):
    monkeypatch.setenv("MXGEMM_AUTOTUNE", value)
    assert settings.autotune_enabled() is expected


def test_autotune_refuses_other_words(monkeypatch):
    monkeypatch.setenv("MXGEMM_AUTOTUNE", "maybe")
    with pytest.raises(settings.SettingsError, match=r"MXGEMM_AUTOTUNE='maybe'.*1/true/yes/on or 0/false/no/off"):
        settings.autotune_enabled()


@pytest.mark.parametrize("value", ["nan", "inf", "-1e-5", "one", "1e-5x"])
def test_reencode_limit_must_be_a_finite_nonnegative_number(monkeypatch, value):
    """NaN would switch the re-encoding check off (every comparison with it is false): refused like the rest."""
    monkeypatch.setenv("MXGEMM_REENCODE_MAX_ERROR", value)
    q, s = random_mx_weight(128, 256)
    with pytest.raises(settings.SettingsError, match="MXGEMM_REENCODE_MAX_ERROR"):
        HybridSM90Backend().prepare(q, s, "hybrid-block128")


def test_reencode_limit_is_applied(monkeypatch):
    q, s = random_mx_weight(128, 256)
    s = s.clone()
    s[0, 0] += 10  # pushes its 128x128 block's other 32-blocks into E4M3's subnormals
    monkeypatch.setenv("MXGEMM_REENCODE_MAX_ERROR", "1")
    assert HybridSM90Backend().prepare(q, s, "hybrid-block128").info["reencode"].rel_error > 1e-5
    monkeypatch.setenv("MXGEMM_REENCODE_MAX_ERROR", "1e-5")
    with pytest.raises(Exception, match="above MXGEMM_REENCODE_MAX_ERROR=1e-05"):
        HybridSM90Backend().prepare(q, s, "hybrid-block128")


def test_backend_and_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("MXGEMM_BACKEND", "  ")
    assert settings.backend_request() == "auto"
    monkeypatch.setenv("MXGEMM_BACKEND", " triton ")
    assert settings.backend_request() == "triton"
    monkeypatch.setenv("MXGEMM_CACHE_DIR", str(tmp_path))
    assert settings.cache_dir() == tmp_path


def test_an_unknown_backend_in_the_environment_is_named_as_the_variables(monkeypatch):
    import torch

    import mxgemm

    monkeypatch.setenv("MXGEMM_BACKEND", "foo")
    q, s = random_mx_weight(32, 64)
    with pytest.raises(mxgemm.UnknownBackendError, match=r"MXGEMM_BACKEND='foo' is not a backend; valid names: auto"):
        mxgemm.prepare_weight(q, s)
    assert mxgemm.prepare_weight(q, s, backend="emulation").backend == "emulation"  # a named one needs no variable
    assert torch.isfinite(
        mxgemm.linear(torch.randn(2, 64, dtype=torch.bfloat16), mxgemm.prepare_weight(q, s, backend="emulation"))
    ).all()


def test_mxgemm_info_flags_every_bad_setting(monkeypatch, capsys):
    from mxgemm.cli import main

    monkeypatch.setenv("MXGEMM_BACKEND", "foo")
    monkeypatch.setenv("MXGEMM_AUTOTUNE", "maybe")
    monkeypatch.setenv("MXGEMM_REENCODE_MAX_ERROR", "nan")
    monkeypatch.setenv("MXGEMM_EAGER_GRAPHS", "sometimes")
    assert main(["info"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    names = ("MXGEMM_BACKEND='foo'", "MXGEMM_AUTOTUNE='maybe'", "MXGEMM_REENCODE_MAX_ERROR='nan'")
    for name in (*names, "MXGEMM_EAGER_GRAPHS='sometimes'"):
        assert f"warning: {name}" in out, name
