"""The docs site builds with warnings as errors (mkdocs with mkdocstrings: the pages under docs/ and the API reference
from the docstrings), and every page under docs/ is in its navigation."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_docs_site_builds_strict_with_every_page(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    nav = (REPO / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    api = (site / "api" / "index.html").read_text()
    assert all(name in api for name in ("quantize_model", "prepare_grouped_weight", "MXFP8Config"))
