"""A regular (non-editable) install works: the wheel carries the registry, the built Hub repos, the
benchmark suite and the examples; installed from it, kernels-neuron lists, installs, runs the demo and
kernelizes, and refuses to rewrite its read-only build/. Building the wheel leaves the checkout's
build/ as it was."""

import json
import os
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

from kernels_neuron import hub, paths


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(paths.DATA_DIR),
            "-w",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = out.glob("kernels_neuron-*.whl")
    return path


def test_the_wheel_carries_what_a_checkout_keeps_at_its_root_and_leaves_build_clean(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "kernels_neuron/_data/registry.toml" in names
    assert {f"kernels_neuron/_data/build/{p}" for p in hub.build_tree()} <= names
    assert {
        "kernels_neuron/bench/suite.py",
        "kernels_neuron/_data/examples/sft.py",
        "nki_src/attention.py",
        "kernels_neuron/ops/attention_launches.py",
    } <= names
    assert not any("__pycache__" in n for n in names)
    assert hub.stale() == [] and not (paths.BUILD_DIR / "lib").exists()  # no scratch folder in build/


@pytest.mark.slow
def test_installed_from_the_wheel_list_install_demo_and_kernelize_work(wheel, tmp_path):
    environment = tmp_path / "venv"
    venv.create(environment, with_pip=False)
    python = environment / "bin" / "python"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # torch, transformers ... from this environment, without its editable kernels-neuron (a .pth here
    # adds the directory only: the editable install's own .pth files there are not processed)
    site = next(environment.glob("lib/python*/site-packages"))
    (site / "zz_dependencies.pth").write_text(next(p for p in sys.path if p.endswith("site-packages")) + "\n")
    script = textwrap.dedent(f"""
        import contextlib, io, json
        import kernels_neuron
        from kernels_neuron import cli, paths
        from transformers import LlamaConfig, LlamaForCausalLM
        codes = {{}}
        with contextlib.redirect_stdout(io.StringIO()) as out:
            for args in (["list"], ["install", "--cache", {str(tmp_path / "cache")!r}], ["demo"], ["build"],
                         ["build", "--check"], ["bench", "--filter", "decode128"]):
                codes[" ".join(args[:1] if args[0] == "install" else args)] = cli.main(args)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1, vocab_size=32))
        report = kernels_neuron.kernelize(model.eval(), device="neuron").kernels_neuron_report
        print(json.dumps({{"file": kernels_neuron.__file__, "checkout": paths.IS_CHECKOUT, "codes": codes,
                           "swapped": len(report.swapped), "demo": "demo passed" in out.getvalue(),
                           "read_only": "read-only" in out.getvalue()}}))
    """)
    # PYTHONPATH (a checkout on it, as while working in a worktree) would shadow the installed package
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).is_relative_to(environment) and result["checkout"] is False
    assert result["codes"] == {
        "list": 0,
        "install": 0,
        "demo": 0,
        "build": 2,
        "build --check": 0,
        "bench --filter decode128": 0,
    }
    assert result["demo"] and result["read_only"] and result["swapped"] == 5
    assert (tmp_path / "cache" / "kernels--kernels-neuron--neuron-rmsnorm" / "refs" / "v1").is_file()
