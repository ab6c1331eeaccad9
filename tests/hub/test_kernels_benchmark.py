"""``kernels benchmark`` (the kernels library's CLI) runs the repo's shipped benchmark offline and
verifies every workload against its reference. Needs ``tabulate`` (the ``bench`` extra).

The CLI runs once per repo, all in one fresh interpreter (the imports are paid once): each run's exit
code, output and results are kept apart, and each repo's test asserts on its own."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kernels_neuron import paths
from kernels_neuron import registry as registry_module
from kernels_neuron.hub import build

# ``kernels benchmark ./build/<repo> ...`` for each repo of argv[1] ({repo: output file}), as the CLI's
# console script runs it; prints one JSON line: each run's exit code and the tails of what it printed.
KERNELS_BENCHMARK_EACH_REPO = textwrap.dedent("""
    import contextlib, gc, io, json, sys, traceback
    gc.disable()  # while the imports create their lasting objects (see tests/conftest.py)
    import torch
    from kernels.cli import main
    gc.freeze()
    gc.enable()

    runs = {}
    for repo, output in json.loads(sys.argv[1]).items():
        sys.argv = ["kernels", "benchmark", f"./build/{repo}", "--iterations", "2", "--warmup", "1",
                    "--output", output]
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                main()
                code = 0
            except SystemExit as exit:
                code = exit.code
            except Exception:
                traceback.print_exc()
                code = 1
        runs[repo] = {"code": code, "stdout": stdout.getvalue()[-2000:], "stderr": stderr.getvalue()[-3000:]}
    print(json.dumps(runs))
""")

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


@pytest.fixture(scope="module")
def benchmark_runs(tmp_path_factory) -> dict:
    """Every repo's ``kernels benchmark`` run: {repo: (the run's exit code and output, its output file)}."""
    reg = registry_module.load()
    scratch = tmp_path_factory.mktemp("kernels-benchmark")
    outputs = {repo: str(scratch / f"{repo}.json") for repo in sorted(REPO_WORKLOADS)}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LOCAL_KERNELS", "KERNELS_"))}
    env.update(
        HF_HOME=str(scratch / "hf-home"),
        HF_HUB_OFFLINE="1",
        LOCAL_KERNELS=f"{reg.repo_id('nki-sim')}={build.BUILD_DIR / 'nki-sim'}",
    )
    done = subprocess.run(
        [sys.executable, "-c", KERNELS_BENCHMARK_EACH_REPO, json.dumps(outputs)],
        cwd=paths.DATA_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    return {repo: (runs[repo], outputs[repo]) for repo in outputs}


@pytest.mark.slow
@pytest.mark.parametrize("repo", sorted(REPO_WORKLOADS))
def test_kernels_benchmark_runs_and_verifies_offline(repo, benchmark_runs):
    run, out = benchmark_runs[repo]
    assert run["code"] == 0, run["stdout"] + run["stderr"]
    with open(out) as f:
        results = json.load(f)["results"]
    assert {r["workload"] for r in results} >= REPO_WORKLOADS[repo]
    for r in results:
        assert r["verified"] is True, r
        assert r["timingResults"]["iterations"] == 2
