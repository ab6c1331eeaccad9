"""``kernels benchmark`` (the kernels library's CLI) runs the repo's shipped benchmark offline and
verifies every workload against its reference. Needs ``tabulate`` (the ``bench`` extra)."""

import json
import os
import subprocess
import sys

import pytest

from kernels_neuron import paths
from kernels_neuron import registry as registry_module
from kernels_neuron.hub import build

KERNELS_CLI = "import sys; from kernels.cli import main; sys.argv[0] = 'kernels'; sys.exit(main())"


REPO_WORKLOADS = {
    "neuron-rmsnorm": {"RMSNormBenchmark.llama", "RMSNormBenchmark.gemma"},
    "neuron-layernorm": {"LayerNormBenchmark.affine", "LayerNormBenchmark.weight_only"},
    "neuron-flash-attn": {
        "FlashAttnBenchmark.causal_prefill",
        "FlashAttnBenchmark.sliding_window",
        "FlashAttnBenchmark.decode",
    },
    "neuron-mlp": {
        "GatedMLPBenchmark.swiglu_prefill",
        "GatedMLPBenchmark.geglu_prefill",
        "GatedMLPBenchmark.swiglu_decode",
        "PlainMLPBenchmark.gelu_tanh_prefill",
    },
    "neuron-moe": {"MoEExpertsBenchmark.prefill", "MoEExpertsBenchmark.decode"},
}


@pytest.mark.slow
@pytest.mark.parametrize("repo", sorted(REPO_WORKLOADS))
def test_kernels_benchmark_runs_and_verifies_offline(repo, tmp_path):
    reg = registry_module.load()
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LOCAL_KERNELS", "KERNELS_"))}
    env.update(
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_OFFLINE="1",
        LOCAL_KERNELS=f"{reg.repo_id('nki-sim')}={build.BUILD_DIR / 'nki-sim'}",
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            KERNELS_CLI,
            "benchmark",
            f"./build/{repo}",
            "--iterations",
            "2",
            "--warmup",
            "1",
            "--output",
            str(out),
        ],
        cwd=paths.DATA_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert {r["workload"] for r in results} >= REPO_WORKLOADS[repo]
    for r in results:
        assert r["verified"] is True, r
        assert r["timingResults"]["iterations"] == 2
