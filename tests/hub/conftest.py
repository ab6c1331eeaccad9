"""Shared fixtures for the hub tests: a stale build, and the built repos loaded in fresh interpreters
through the kernels library alone, one interpreter per route with every repo's load in it
(fresh_interpreter.py, hub_loads.py)."""

import contextlib
import io
import shutil
from pathlib import Path

import pytest
from fresh_interpreter import LOADED_REPOS, fresh_env, local_kernels, run_loads

from kernels_neuron import cli
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


@pytest.fixture(scope="session")
def loads_through_local_kernels(tmp_path_factory) -> dict:
    """Every repo's load through ``LOCAL_KERNELS`` (build/ as it is), then kernels_neuron.sim's capture
    of a kernel loaded before it."""
    home = tmp_path_factory.mktemp("local-kernels")
    env = fresh_env(home, LOCAL_KERNELS=local_kernels(*LOADED_REPOS.values(), "nki-sim"))
    return run_loads([*LOADED_REPOS, "sim_capture"], env, home)


@pytest.fixture(scope="session")
def loads_from_the_hf_cache(tmp_path_factory) -> tuple[Path, str, dict]:
    """``kernels-neuron install --cache`` into an empty cache, then every repo's load through the kernels
    library's ordinary offline Hub path (``HF_HUB_CACHE``, no ``LOCAL_KERNELS``): the cache, what install
    printed and the loads."""
    home = tmp_path_factory.mktemp("hf-cache")
    cache = home / "cache"
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        code = cli.main(["install", "--cache", str(cache)])
    assert code == 0, printed.getvalue()
    return cache, printed.getvalue(), run_loads(list(LOADED_REPOS), fresh_env(home, HF_HUB_CACHE=str(cache)), home)
