"""Loading the built repos the way users will: ``kernels.get_kernel`` through ``LOCAL_KERNELS`` and from
the HF cache that ``kernels-neuron install`` fills (offline), plus the CLI's install and list.

Each load runs in a fresh interpreter with a controlled environment: ``HF_HUB_OFFLINE``, the cache
location and the kernels library's loaded-kernel memo are process-global. The loads of one route share
that interpreter (conftest.py's session fixtures, hub_loads.py).
"""

import importlib
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fresh_interpreter import fresh_env, loaded, local_kernels, run_loads, snapshot_variant

from kernels_neuron import cli, hub
from kernels_neuron import registry as registry_module
from kernels_neuron.hub import build

install_module = importlib.import_module("kernels_neuron.hub.install")  # hub.install is the function

REGISTRY = registry_module.load()
RMSNORM, NKI_SIM = REGISTRY.repo_id("neuron-rmsnorm"), REGISTRY.repo_id("nki-sim")
LAYERS = ("RMSNorm", "GemmaRMSNorm", "RMSNormFP32Multiply")


def _assert_loaded_and_correct(result: dict, variant_dir: Path) -> None:
    assert result["name"].startswith("_neuron_rmsnorm_cpu_")  # the torch-cpu variant on this machine
    assert Path(result["file"]).resolve().parent == variant_dir.resolve()
    assert result["all"] == ["layers", "rms_norm", "rms_norm_reference"]
    assert result["exports"] == {"rms_norm": True, "rms_norm_reference": True}
    assert result["layers"] == {name: True for name in LAYERS}
    assert result["launches"] == 3  # rms_norm ran the NKI kernel, on the simulator it was shipped with
    assert result["nki_is_simulator"] is True
    assert all(error <= 1e-5 for error in result["errors"].values()), result["errors"]
    assert result["checkout_imported"] is False  # the Hub package needs nothing from this checkout


def _assert_installed(cache: Path) -> None:
    for name, repo in REGISTRY.repos.items():
        root = cache / f"kernels--{REGISTRY.org}--{name}"
        sha = (root / "refs" / f"v{repo.version}").read_text()
        assert re.fullmatch(r"[0-9a-f]{40}", sha)
        snapshot = root / "snapshots" / sha
        assert (snapshot / "build" / "torch-cpu" / "metadata.json").is_file()
        assert (snapshot / "README.md").read_bytes() == (build.BUILD_DIR / name / "README.md").read_bytes()


# --- (a) LOCAL_KERNELS ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_get_kernel_through_local_kernels(loads_through_local_kernels):
    result = loaded(loads_through_local_kernels, "rmsnorm")
    _assert_loaded_and_correct(result, build.BUILD_DIR / "neuron-rmsnorm" / "build" / "torch-cpu")


# --- (b) install, then the kernels library's ordinary offline Hub path -----------------------------------


@pytest.mark.slow
def test_install_then_get_kernel_offline_from_the_hf_cache(loads_from_the_hf_cache):
    cache, printed, results = loads_from_the_hf_cache
    assert RMSNORM in printed and NKI_SIM in printed
    _assert_installed(cache)
    _assert_loaded_and_correct(loaded(results, "rmsnorm"), snapshot_variant(cache, "neuron-rmsnorm"))


@pytest.mark.slow
def test_install_defaults_to_the_cache_the_kernels_library_reads(tmp_path):
    """With KERNELS_CACHE set the kernels library reads only that cache, so install must write there
    (the CLI as a process: an HF home of its own, which install must leave alone)."""
    cache = tmp_path / "kernels-cache"
    env = fresh_env(tmp_path, KERNELS_CACHE=str(cache))
    done = subprocess.run(
        [sys.executable, "-m", "kernels_neuron.cli", "install"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _assert_installed(cache)
    assert not (tmp_path / "hf-home").exists()
    result = loaded(run_loads(["rmsnorm"], env, tmp_path), "rmsnorm")
    assert Path(result["file"]).resolve().is_relative_to(cache.resolve())


def test_default_cache_follows_the_kernels_library(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.delenv("KERNELS_CACHE", raising=False)
    assert install_module.default_cache() == Path(constants.HF_HUB_CACHE)
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    assert install_module.default_cache() == tmp_path


# --- (c) install refuses a stale build --------------------------------------------------------------------


def test_install_refuses_a_stale_build(stale_nki_src, tmp_path, capsys):
    cache = tmp_path / "cache"
    assert cli.main(["install", "--cache", str(cache)]) == 1
    out = capsys.readouterr().out
    assert "stale" in out and "kernels-neuron build" in out
    assert not cache.exists()


def test_install_names_the_stale_file(tmp_path):
    out = tmp_path / "build"
    hub.write(out)
    edited = out / "neuron-rmsnorm/build/torch-cpu/layers.py"
    edited.write_text(edited.read_text() + "# edited\n")
    with pytest.raises(RuntimeError, match=r"stale .*~ neuron-rmsnorm/build/torch-cpu/layers.py"):
        hub.install(cache=tmp_path / "cache", build_dir=out)
    assert not (tmp_path / "cache").exists()
    hub.write(out)  # fresh again: installs
    installed = hub.install(cache=tmp_path / "cache", build_dir=out)
    assert set(installed) == {REGISTRY.repo_id(name) for name in REGISTRY.repos}
    _assert_installed(tmp_path / "cache")


# --- (d) the simulator dependency must resolve ----------------------------------------------------------


def test_loading_without_nki_sim_fails_naming_it(tmp_path):
    code = textwrap.dedent(f"""
        import kernels
        try:
            kernels.get_kernel({RMSNORM!r}, version=1)
        except Exception as exc:
            print(type(exc).__name__ + ": " + str(exc))
        else:
            print("LOADED")
    """)
    env = fresh_env(tmp_path, LOCAL_KERNELS=local_kernels("neuron-rmsnorm"))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LOADED" not in done.stdout
    assert NKI_SIM in done.stdout, done.stdout


# --- (e) kernels-neuron list ------------------------------------------------------------------------------


def test_list_names_every_layer_up_to_date(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for entry in REGISTRY.layers + REGISTRY.attention:
        assert entry.name in out and f"{REGISTRY.repo_id(entry.repo)} v{REGISTRY.repos[entry.repo].version}" in out
    assert out.count("up to date") == len(REGISTRY.layers) + len(REGISTRY.attention)
    assert "stale" not in out and "missing" not in out


@pytest.mark.parametrize("source", ["NKI_DIR", "SIM_DIR"])
def test_list_shows_stale_layers_when_their_kernel_or_the_simulator_changes(source, tmp_path, monkeypatch, capsys):
    original = getattr(build, source)
    copy = tmp_path / original.name
    shutil.copytree(original, copy, ignore=shutil.ignore_patterns("__pycache__"))
    edited = copy / ("rmsnorm.py" if source == "NKI_DIR" else "isa.py")
    edited.write_text(edited.read_text() + "# changed\n")
    monkeypatch.setattr(build, source, copy)
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    # rmsnorm.py reaches the norm layers' repo only; the simulator reaches every kernel repo.
    norm_layers = [layer for layer in REGISTRY.layers if layer.repo == "neuron-rmsnorm"]
    stale_rows = len(REGISTRY.layers) + len(REGISTRY.attention) if source == "SIM_DIR" else len(norm_layers)
    assert out.count("stale") == stale_rows
    assert out.count("up to date") == len(REGISTRY.layers) + len(REGISTRY.attention) - stale_rows


# --- neuron-flash-attn: the same two offline routes ----------------------------------------------------

FLASH_ATTN_EXPORTS = sorted(REGISTRY.repos["neuron-flash-attn"].export_names)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["local_kernels", "installed"])
def test_flash_attn_repo_loads_offline_and_runs(route, request):
    """Its attention entry points, forward and backward, against the reference it ships."""
    if route == "local_kernels":
        result = loaded(request.getfixturevalue("loads_through_local_kernels"), "flash_attn")
        variant_dir = build.BUILD_DIR / "neuron-flash-attn" / "build" / "torch-cpu"
    else:
        cache, _, results = request.getfixturevalue("loads_from_the_hf_cache")
        result = loaded(results, "flash_attn")
        variant_dir = snapshot_variant(cache, "neuron-flash-attn")
    assert result["name"].startswith("_neuron_flash_attn_cpu_")
    assert Path(result["file"]).resolve().parent == variant_dir.resolve()
    assert result["all"] == sorted(["layers", *FLASH_ATTN_EXPORTS]) and result["has_layers"]
    assert all(error <= 1e-5 for error in result["errors"].values()), result["errors"]
    assert result["kernels"] == ["flash_attn_bwd"] + ["flash_attn_fwd"] * 4  # all on the shipped simulator
    assert result["checkout_imported"] is False


@pytest.mark.slow
def test_sim_capture_sees_launches_of_kernels_loaded_before_kernels_neuron(loads_through_local_kernels):
    """A Hub kernel loaded first brings its own copy of the simulator (nki-sim) as ``nki``;
    kernels_neuron.sim.capture(), imported afterwards, still sees its launches."""
    result = loaded(loads_through_local_kernels, "sim_capture")
    assert result == {"launches": 1, "kernel": "rmsnorm_fwd", "nki_is_the_hub_copy": True}
