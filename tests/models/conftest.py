"""The shared parametrisation of the model-level tests (one tiny model per architecture), and the checks
that need a fresh process (fresh_process.py), run once for every test that asserts on them."""

import os
from pathlib import Path

import pytest
import torch
from fresh_run import run_script
from tiny_models import ARCHS, build_tiny

from kernels_neuron import registry as registry_module

FRESH_PROCESS = Path(__file__).with_name("fresh_process.py")


@pytest.fixture(params=list(ARCHS))
def arch(request):
    """Each architecture of ``tiny_models.ARCHS`` (Llama ... Gemma3)."""
    return request.param


@pytest.fixture
def tiny():
    """The factory: ``tiny(arch, **config_overrides)`` builds a fresh fp32 eval-mode model."""
    return build_tiny


# The checkpoints use_kernels loads: OLMo2 (tagged "RMSNorm" by transformers, fp32-multiply numerics),
# Gemma (not tagged) and a checkpoint-style tiny Llama (hidden 32).
USE_KERNELS_CHECKPOINTS = {
    "olmo2": ("olmo2", {}),
    "gemma": ("gemma", {}),
    "llama32": (
        "llama",
        dict(hidden_size=32, head_dim=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64),
    ),
}


@pytest.fixture(scope="session")
def fresh_process(tmp_path_factory) -> dict:
    """fresh_process.py's checks in one new interpreter, offline, with an HF home of its own and no
    LOCAL_KERNELS or KERNELS_* settings: {check: its result}."""
    home = tmp_path_factory.mktemp("fresh-process")
    checkpoints = {}
    for name, (arch, overrides) in USE_KERNELS_CHECKPOINTS.items():
        checkpoints[name] = str(home / name)
        build_tiny(arch, **overrides).to(torch.bfloat16).save_pretrained(checkpoints[name])
    request = {
        "checks": ["compatible_flash", "use_kernels"],
        "hub": registry_module.load().repo_id("neuron-flash-attn"),
        "checkpoints": checkpoints,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LOCAL_KERNELS", "KERNELS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(home / "hf-home"))
    return run_script(FRESH_PROCESS, request, env, home)
