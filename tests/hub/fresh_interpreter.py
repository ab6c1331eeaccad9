"""Loading the built repos in a fresh interpreter (hub_loads.py) with a controlled environment:
``HF_HUB_OFFLINE``, the cache location and the kernels library's loaded-kernel memo are process-global."""

import os
from pathlib import Path

from fresh_run import run_script

from kernels_neuron import registry as registry_module
from kernels_neuron.hub import build

REGISTRY = registry_module.load()
HUB_LOADS = Path(__file__).with_name("hub_loads.py")
# hub_loads' short names for the repos it loads
LOADED_REPOS = {"rmsnorm": "neuron-rmsnorm", "flash_attn": "neuron-flash-attn", "mlp": "neuron-mlp"}


def fresh_env(home: Path, **extra: str) -> dict[str, str]:
    """The current environment without anything that steers HF or the kernels library, offline,
    with an empty HF home of its own (``home``); then ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_", "LOCAL_KERNELS", "KERNELS_", "DISABLE_KERNEL_MAPPING"))
    }
    env.update(HF_HOME=str(home / "hf-home"), HF_HUB_OFFLINE="1", **extra)
    return env


def local_kernels(*repos: str) -> str:
    """``LOCAL_KERNELS`` pointing the kernels library at these repos in build/."""
    return ":".join(f"{REGISTRY.repo_id(name)}={build.BUILD_DIR / name}" for name in repos)


def run_loads(loads: list[str], env: dict[str, str], cwd: Path) -> dict:
    """hub_loads.py's ``loads`` in one fresh interpreter: each load's result (or its error)."""
    request = {"repos": {short: REGISTRY.repo_id(name) for short, name in LOADED_REPOS.items()}, "loads": loads}
    return run_script(HUB_LOADS, request, env, cwd)


def loaded(results: dict, load: str) -> dict:
    """One load's result; fails with the traceback of a load that raised."""
    result = results[load]
    assert "error" not in result, f"{load}: {result['error']}"
    return result


def snapshot_variant(cache: Path, repo: str) -> Path:
    """The torch-cpu variant of ``repo``'s v1 snapshot in an installed cache."""
    root = cache / f"kernels--{REGISTRY.org}--{repo}"
    return root / "snapshots" / (root / "refs" / "v1").read_text() / "build" / "torch-cpu"
