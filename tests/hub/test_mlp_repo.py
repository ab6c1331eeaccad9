"""The neuron-mlp Hub repo loads offline through the kernels library (LOCAL_KERNELS, and the HF cache
that ``kernels-neuron install`` fills), exports its op, reference and layers, and runs forward and
backward on the simulator shipped as its nki-sim dependency, without this checkout."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernels_neuron import hub
from kernels_neuron import registry as registry_module
from kernels_neuron.hub import build

REGISTRY = registry_module.load()
MLP = REGISTRY.repo_id("neuron-mlp")
EXPORTS = sorted(REGISTRY.repos["neuron-mlp"].export_names)

LOAD_AND_RUN = textwrap.dedent(f"""
    import json, sys
    import torch, kernels

    kernel = kernels.get_kernel({MLP!r}, version=1)
    sim = next(m for name, m in sys.modules.items() if name.startswith("_nki_sim_cpu_") and "." not in name)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 70, 96, generator=gen)
    w_gate, w_up = (torch.randn(200, 96, generator=gen) / 10 for _ in range(2))
    w_down = torch.randn(96, 200, generator=gen) / 14
    errors = {{}}
    with sim.capture() as traces:
        for act in ("silu", "gelu_tanh"):
            got, ref = kernel.gated_mlp(x, w_gate, w_up, w_down, act), kernel.gated_mlp_reference(x, w_gate, w_up, w_down, act)
            errors[act] = (got - ref).abs().max().item()
        fused = torch.cat([w_gate, w_up]).requires_grad_(True)
        kernel.gated_mlp(x, fused, None, w_down).square().sum().backward()
        ref = fused.detach().clone().requires_grad_(True)
        kernel.gated_mlp_reference(x, ref, None, w_down).square().sum().backward()
        errors["d_gate_up"] = ((fused.grad - ref.grad).abs().max() / ref.grad.abs().max()).item()
    layers = sorted(n for n in ("GatedMLP", "GatedMLPFusedGateUp") if issubclass(getattr(kernel.layers, n), torch.nn.Module))
    print(json.dumps({{"name": kernel.__name__, "file": kernel.__file__, "all": sorted(kernel.__all__), "layers": layers,
                       "errors": errors, "kernels": sorted(t.kernel for t in traces),
                       "checkout_imported": "kernels_neuron" in sys.modules}}))
""")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_", "LOCAL_KERNELS", "KERNELS_", "DISABLE_KERNEL_MAPPING"))
    }
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1", **extra)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("route", ["local_kernels", "installed"])
def test_mlp_repo_loads_offline_and_runs(route, tmp_path):
    if route == "local_kernels":
        local = ":".join(f"{REGISTRY.repo_id(n)}={build.BUILD_DIR / n}" for n in ("neuron-mlp", "nki-sim"))
        env = _env(tmp_path, LOCAL_KERNELS=local)
        variant_dir = build.BUILD_DIR / "neuron-mlp" / "build" / "torch-cpu"
    else:
        cache = tmp_path / "cache"
        hub.install(cache=cache)
        env = _env(tmp_path, HF_HUB_CACHE=str(cache))
        root = cache / f"kernels--{REGISTRY.org}--neuron-mlp"
        variant_dir = root / "snapshots" / (root / "refs" / "v1").read_text() / "build" / "torch-cpu"
    done = subprocess.run(
        [sys.executable, "-c", LOAD_AND_RUN], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["name"].startswith("_neuron_mlp_cpu_")
    assert Path(result["file"]).resolve().parent == variant_dir.resolve()
    assert result["all"] == sorted(["layers", *EXPORTS]) and result["layers"] == ["GatedMLP", "GatedMLPFusedGateUp"]
    assert result["errors"]["silu"] <= 1e-5 and result["errors"]["gelu_tanh"] <= 1e-5, result["errors"]
    assert result["errors"]["d_gate_up"] <= 1e-5, result["errors"]
    assert result["kernels"] == ["mlp_bwd", "mlp_fwd", "mlp_fwd", "mlp_fwd"]  # all on the shipped simulator
    assert result["checkout_imported"] is False
