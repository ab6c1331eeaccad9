"""Loading the built repos the way users will: ``kernels.get_kernel`` through ``LOCAL_KERNELS`` and from
the HF cache that ``kernels-neuron install`` fills (offline), plus the CLI's install and list.

Each load runs in a fresh interpreter with a controlled environment: ``HF_HUB_OFFLINE``, the cache
location and the kernels library's loaded-kernel memo are process-global.
"""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernels_neuron import cli, hub
from kernels_neuron import registry as registry_module
from kernels_neuron.hub import build

install_module = importlib.import_module("kernels_neuron.hub.install")  # hub.install is the function

REGISTRY = registry_module.load()
RMSNORM, NKI_SIM = REGISTRY.repo_id("neuron-rmsnorm"), REGISTRY.repo_id("nki-sim")
LAYERS = ("RMSNorm", "GemmaRMSNorm", "RMSNormFP32Multiply")

# Loads neuron-rmsnorm v1, checks what it exports and runs rms_norm against the reference on the
# simulator that came with it (the nki-sim dependency); prints one JSON line.
LOAD_AND_RUN = textwrap.dedent(f"""
    import json, sys
    import torch, kernels

    kernel = kernels.get_kernel({RMSNORM!r}, version=1)
    sim = next(m for name, m in sys.modules.items() if name.startswith("_nki_sim_cpu_") and "." not in name)
    x, w = torch.randn(3, 5, 256), torch.randn(256) * 0.1 + 1.0
    errors = {{}}
    with sim.capture() as traces:
        for convention in ("llama", "gemma", "fp32_multiply"):
            got, ref = kernel.rms_norm(x, w, 1e-6, convention), kernel.rms_norm_reference(x, w, 1e-6, convention)
            errors[convention] = (got - ref).abs().max().item()
    layers = {{name: isinstance(getattr(kernel.layers, name, None), type)
                     and issubclass(getattr(kernel.layers, name), torch.nn.Module) for name in {LAYERS!r}}}
    print(json.dumps({{"name": kernel.__name__, "file": kernel.__file__, "all": sorted(kernel.__all__),
                       "exports": {{n: callable(getattr(kernel, n, None)) for n in ("rms_norm", "rms_norm_reference")}},
                       "layers": layers, "errors": errors, "launches": len(traces),
                       "nki_is_simulator": getattr(sys.modules.get("nki"), "__kernels_neuron_simulator__", False),
                       "checkout_imported": "kernels_neuron" in sys.modules}}))
""")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The current environment without anything that steers HF or the kernels library, offline,
    with an empty HF home of its own; then ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_", "LOCAL_KERNELS", "KERNELS_", "DISABLE_KERNEL_MAPPING"))
    }
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", **extra)
    return env


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def _load(env: dict[str, str], cwd: Path) -> dict:
    done = _run([sys.executable, "-c", LOAD_AND_RUN], env, cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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


def _local_kernels(*repos: str) -> str:
    return ":".join(f"{REGISTRY.repo_id(name)}={build.BUILD_DIR / name}" for name in repos)


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
def test_get_kernel_through_local_kernels(tmp_path):
    result = _load(_env(tmp_path, LOCAL_KERNELS=_local_kernels("neuron-rmsnorm", "nki-sim")), tmp_path)
    _assert_loaded_and_correct(result, build.BUILD_DIR / "neuron-rmsnorm" / "build" / "torch-cpu")


# --- (b) install, then the kernels library's ordinary offline Hub path -----------------------------------


@pytest.mark.slow
def test_install_then_get_kernel_offline_from_the_hf_cache(tmp_path):
    cache = tmp_path / "cache"
    done = _run(
        [sys.executable, "-m", "kernels_neuron.cli", "install", "--cache", str(cache)], _env(tmp_path), tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert RMSNORM in done.stdout and NKI_SIM in done.stdout
    _assert_installed(cache)
    result = _load(_env(tmp_path, HF_HUB_CACHE=str(cache)), tmp_path)  # no LOCAL_KERNELS
    sha = (cache / f"kernels--{REGISTRY.org}--neuron-rmsnorm" / "refs" / "v1").read_text()
    snapshot = cache / f"kernels--{REGISTRY.org}--neuron-rmsnorm" / "snapshots" / sha
    _assert_loaded_and_correct(result, snapshot / "build" / "torch-cpu")


@pytest.mark.slow
def test_install_defaults_to_the_cache_the_kernels_library_reads(tmp_path):
    """With KERNELS_CACHE set the kernels library reads only that cache, so install must write there."""
    cache = tmp_path / "kernels-cache"
    env = _env(tmp_path, KERNELS_CACHE=str(cache))
    done = _run([sys.executable, "-m", "kernels_neuron.cli", "install"], env, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    _assert_installed(cache)
    assert not (tmp_path / "hf-home").exists()
    result = _load(env, tmp_path)
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
    done = _run([sys.executable, "-c", code], _env(tmp_path, LOCAL_KERNELS=_local_kernels("neuron-rmsnorm")), tmp_path)
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

FLASH_ATTN = REGISTRY.repo_id("neuron-flash-attn")
FLASH_ATTN_EXPORTS = sorted(REGISTRY.repos["neuron-flash-attn"].export_names)

# Loads neuron-flash-attn v1 and runs its attention entry points (forward and backward) against the
# reference it ships; prints one JSON line.
LOAD_AND_RUN_FLASH_ATTN = textwrap.dedent(f"""
    import json, sys
    import torch, kernels

    kernel = kernels.get_kernel({FLASH_ATTN!r}, version=1)
    sim = next(m for name, m in sys.modules.items() if name.startswith("_nki_sim_cpu_") and "." not in name)
    q, k, v = (torch.randn(2, h, 40, 64) for h in (4, 2, 2))
    ref = kernel.attention_reference(q, k, v, causal=True, window=9)
    errors = {{}}
    with sim.capture() as traces:
        errors["flash_attention"] = (kernel.flash_attention(q, k, v, causal=True, window=9) - ref).abs().max().item()
        out = kernel.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                                     window_size=(8, 8))
        errors["flash_attn_func"] = (out.transpose(1, 2) - ref).abs().max().item()
        out, _ = kernel.flash_attn_forward(None, q, k, v, None, sliding_window=9)
        errors["flash_attn_forward"] = (out.transpose(1, 2) - ref).abs().max().item()
        leaf = q.clone().requires_grad_(True)
        kernel.flash_attention(leaf, k, v, causal=True).sum().backward()
        ref_leaf = q.clone().requires_grad_(True)
        kernel.attention_reference(ref_leaf, k, v, causal=True).sum().backward()
        errors["dq"] = (leaf.grad - ref_leaf.grad).abs().max().item()
    print(json.dumps({{"name": kernel.__name__, "file": kernel.__file__, "all": sorted(kernel.__all__),
                       "has_layers": hasattr(kernel, "layers"), "errors": errors,
                       "kernels": sorted(t.kernel for t in traces),
                       "checkout_imported": "kernels_neuron" in sys.modules}}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("route", ["local_kernels", "installed"])
def test_flash_attn_repo_loads_offline_and_runs(route, tmp_path):
    if route == "local_kernels":
        env = _env(tmp_path, LOCAL_KERNELS=_local_kernels("neuron-flash-attn", "nki-sim"))
        variant_dir = build.BUILD_DIR / "neuron-flash-attn" / "build" / "torch-cpu"
    else:
        cache = tmp_path / "cache"
        hub.install(cache=cache)
        env = _env(tmp_path, HF_HUB_CACHE=str(cache))
        root = cache / f"kernels--{REGISTRY.org}--neuron-flash-attn"
        variant_dir = root / "snapshots" / (root / "refs" / "v1").read_text() / "build" / "torch-cpu"
    done = _run([sys.executable, "-c", LOAD_AND_RUN_FLASH_ATTN], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["name"].startswith("_neuron_flash_attn_cpu_")
    assert Path(result["file"]).resolve().parent == variant_dir.resolve()
    assert result["all"] == sorted(["layers", *FLASH_ATTN_EXPORTS]) and result["has_layers"]
    assert all(error <= 1e-5 for error in result["errors"].values()), result["errors"]
    assert result["kernels"] == ["flash_attn_bwd"] + ["flash_attn_fwd"] * 4  # all on the shipped simulator
    assert result["checkout_imported"] is False


@pytest.mark.slow
def test_sim_capture_sees_launches_of_kernels_loaded_before_kernels_neuron():
    """A Hub kernel loaded first brings its own copy of the simulator (nki-sim) as ``nki``;
    kernels_neuron.sim.capture(), imported afterwards, still sees its launches."""
    code = textwrap.dedent(f"""
        import json, torch, kernels
        kernel = kernels.get_kernel({RMSNORM!r}, version=1)
        from kernels_neuron import sim
        import nki
        with sim.capture() as traces:
            kernel.rms_norm(torch.randn(3, 256), torch.ones(256), 1e-6)
        print(json.dumps({{"launches": len(traces), "kernel": traces[0].kernel if traces else None,
                           "nki_is_the_hub_copy": not nki.__name__.startswith("kernels_neuron")}}))
    """)
    done = _run(
        [sys.executable, "-c", code],
        _env(Path(os.environ.get("TMPDIR", "/tmp")), LOCAL_KERNELS=_local_kernels("neuron-rmsnorm", "nki-sim")),
        Path.cwd(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"launches": 1, "kernel": "rmsnorm_fwd", "nki_is_the_hub_copy": True}
