"""Shared fixtures for the hub tests."""

import shutil

import pytest

from kernels_neuron.hub import build


@pytest.fixture
def stale_nki_src(tmp_path, monkeypatch):
    """Point the builder at a copy of nki_src/ whose rmsnorm.py differs by one comment, so build/ is stale
    (the real tree is never touched)."""
    copy = tmp_path / "nki_src"
    shutil.copytree(build.NKI_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with (copy / "rmsnorm.py").open("a") as f:
        f.write("# changed\n")
    monkeypatch.setattr(build, "NKI_DIR", copy)
    return copy
