"""The neuron-mlp Hub repo loads offline through the kernels library (LOCAL_KERNELS, and the HF cache
that ``kernels-neuron install`` fills), exports its op, reference and layers, and runs forward and
backward on the simulator shipped as its nki-sim dependency, without this checkout (the loads run in
conftest.py's fresh interpreters, beside the other repos')."""

from pathlib import Path

import pytest
from fresh_interpreter import loaded, snapshot_variant

from kernels_neuron import registry as registry_module
from kernels_neuron.hub import build

REGISTRY = registry_module.load()
EXPORTS = sorted(REGISTRY.repos["neuron-mlp"].export_names)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["local_kernels", "installed"])
def test_mlp_repo_loads_offline_and_runs(route, request):
    if route == "local_kernels":
        result = loaded(request.getfixturevalue("loads_through_local_kernels"), "mlp")
        variant_dir = build.BUILD_DIR / "neuron-mlp" / "build" / "torch-cpu"
    else:
        cache, _, results = request.getfixturevalue("loads_from_the_hf_cache")
        result = loaded(results, "mlp")
        variant_dir = snapshot_variant(cache, "neuron-mlp")
    assert result["name"].startswith("_neuron_mlp_cpu_")
    assert Path(result["file"]).resolve().parent == variant_dir.resolve()
    assert result["all"] == sorted(["layers", *EXPORTS]) and result["layers"] == ["GatedMLP", "GatedMLPFusedGateUp"]
    assert result["errors"]["silu"] <= 1e-5 and result["errors"]["gelu_tanh"] <= 1e-5, result["errors"]
    assert result["errors"]["d_gate_up"] <= 1e-5, result["errors"]
    assert result["kernels"] == ["mlp_bwd", "mlp_fwd", "mlp_fwd", "mlp_fwd"]  # all on the shipped simulator
    assert result["checkout_imported"] is False
