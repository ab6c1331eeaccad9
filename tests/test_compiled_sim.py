"""The compiled build of the simulator's hot modules (kernels_neuron/compiled_sim.py, `kernels-neuron compile-sim`).

The test run itself uses the Python sources (conftest.py). Here one small module is compiled for real,
into a private cache, and a subprocess simulates with it."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kernels_neuron import compiled_sim, sim
from kernels_neuron.sim import examples

SMALL_MODULE = ("kernels_neuron.sim.trace",)  # the quickest to compile (a few seconds)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELS_NEURON_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_build(folder, modules=SMALL_MODULE):
    """A folder laid out as a complete build (empty files in place of the extension modules)."""
    folder.mkdir(parents=True)
    for module in modules:
        compiled_sim._extension(folder, module).touch()
    (folder / "complete").write_text("\n".join(modules))


def test_a_build_counts_only_for_the_sources_it_was_made_from(private_cache, tmp_path, monkeypatch):
    assert not compiled_sim.is_built(SMALL_MODULE)
    folder = compiled_sim.build_dir(SMALL_MODULE)
    fake_build(folder)
    assert compiled_sim.is_built(SMALL_MODULE)
    compiled_sim._extension(folder, SMALL_MODULE[0]).unlink()
    assert not compiled_sim.is_built(SMALL_MODULE)  # damaged: counts as none (compile-sim replaces it)
    compiled_sim._extension(folder, SMALL_MODULE[0]).touch()
    assert compiled_sim.build_dir(compiled_sim.MODULES) != folder  # another module set, another build
    edited = compiled_sim._module_file(tmp_path, SMALL_MODULE[0])  # a copy of the package tree, edited
    edited.parent.mkdir(parents=True)
    edited.write_text(
        compiled_sim._module_file(compiled_sim.SOURCE_ROOT, SMALL_MODULE[0]).read_text() + "\n# an edit\n"
    )
    monkeypatch.setattr(compiled_sim, "SOURCE_ROOT", tmp_path)
    assert not compiled_sim.is_built(SMALL_MODULE)  # the edited source falls back to Python


def test_asking_for_the_build_without_one_warns_and_keeps_the_sources(private_cache, monkeypatch):
    monkeypatch.setenv("KERNELS_NEURON_SIM_COMPILED", "1")
    # As in a process started now (a test run on the build has its finder in place already).
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, compiled_sim._CompiledFinder)])
    with pytest.warns(UserWarning, match="=1, but there is no compiled build .*kernels-neuron compile-sim"):
        assert compiled_sim.activate(SMALL_MODULE) is False
    assert not any(isinstance(f, compiled_sim._CompiledFinder) for f in sys.meta_path)


def test_only_the_newest_builds_of_other_sources_are_kept(private_cache):
    root = private_cache / "compiled-sim"
    tag = sys.implementation.cache_tag
    builds = [root / f"{tag}-{n:020d}" for n in range(6)]
    for age, folder in enumerate(builds):  # builds[0] the newest
        fake_build(folder)
        os.utime(folder / "complete", (1e9 - age, 1e9 - age))
    unfinished = root / f"{tag}-{99:020d}"
    unfinished.mkdir()  # no marker: another process's build in progress, not touched
    compiled_sim._prune(builds[0])
    kept = sorted(p.name for p in root.iterdir())
    assert kept == sorted(b.name for b in builds[: 1 + compiled_sim.KEPT_BUILDS]) + [unfinished.name]


def test_compile_sim_without_cython_names_the_extra_to_install(private_cache, monkeypatch):
    real_find_spec = compiled_sim.importlib.util.find_spec
    monkeypatch.setattr(
        compiled_sim.importlib.util, "find_spec", lambda name: None if name == "Cython" else real_find_spec(name)
    )
    with pytest.raises(RuntimeError, match=r"needs Cython: pip install 'kernels-neuron\[fast\]'"):
        compiled_sim.build(SMALL_MODULE)
    assert not compiled_sim.build_dir(SMALL_MODULE).exists()


@pytest.mark.slow
def test_a_compiled_module_simulates_as_its_source_does(private_cache):
    damaged = compiled_sim.build_dir(SMALL_MODULE)
    damaged.mkdir(parents=True)
    (damaged / "complete").write_text("")  # the marker without the extension: a damaged build, replaced
    folder = compiled_sim.build(SMALL_MODULE, jobs=1)
    assert compiled_sim.is_built(SMALL_MODULE) and folder == damaged
    assert compiled_sim.build(SMALL_MODULE) == folder  # built once
    script = textwrap.dedent(
        f"""
        import json, sys
        import numpy as np
        from kernels_neuron import compiled_sim
        compiled = sys.argv[1] == "1" and compiled_sim.activate({SMALL_MODULE!r})
        from kernels_neuron import sim
        sim.install()
        from kernels_neuron.sim import examples
        x = np.arange(256 * 96, dtype=np.float32).reshape(256, 96) / 1000
        result = sim.run(examples.row_softmax, x)
        print(json.dumps({{
            "compiled": compiled,
            "status": compiled_sim.status(),
            "loaded": compiled_sim.loaded(),
            "trace": [[i.op, i.engine, i.partitions, i.free_elements, i.hbm_bytes_read] for i in result.trace],
            "out": result.outputs.tolist(),
        }}))
        """
    )
    runs = {}
    for flag in ("1", "0"):  # "0": the negative control, the same process without the build
        env = {**os.environ, "KERNELS_NEURON_SIM_COMPILED": flag}
        done = subprocess.run([sys.executable, "-c", script, flag], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        runs[flag] = json.loads(done.stdout)
    assert runs["1"]["compiled"] and runs["1"]["loaded"] == list(SMALL_MODULE)
    assert runs["1"]["status"].startswith("compiled (1 modules")
    assert runs["0"]["loaded"] == [] and runs["0"]["status"].startswith("pure Python")
    assert runs["1"]["trace"] == runs["0"]["trace"] and len(runs["1"]["trace"]) > 0
    assert runs["1"]["out"] == runs["0"]["out"]
    x = np.arange(256 * 96, dtype=np.float32).reshape(256, 96) / 1000
    np.testing.assert_allclose(np.asarray(runs["1"]["out"], np.float32), examples.row_softmax_reference(x), rtol=1e-6)
    assert [i.op for i in sim.run(examples.row_softmax, x).trace] == [op for op, *_ in runs["1"]["trace"]]


def test_the_command_names_the_extra_to_install(private_cache, monkeypatch, capsys):
    from kernels_neuron.cli import main

    real_find_spec = compiled_sim.importlib.util.find_spec
    monkeypatch.setattr(
        compiled_sim.importlib.util, "find_spec", lambda name: None if name == "Cython" else real_find_spec(name)
    )
    assert main(["compile-sim"]) == 1
    assert "pip install 'kernels-neuron[fast]'" in capsys.readouterr().out  # brackets printed, not markup
