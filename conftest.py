"""Every test process runs the simulator's Python sources, whether or not a compiled build of them is in
the cache (``kernels-neuron compile-sim``): the doctests are collected from those sources, and a test
run checks what a fresh clone runs. tests/test_compiled_sim.py tests the compiled build on its own, and
``KERNELS_NEURON_SIM_COMPILED=1 python -m pytest tests -o addopts=-ra`` runs the tests on it (no doctests)."""

import os

os.environ.setdefault("KERNELS_NEURON_SIM_COMPILED", "0")
if os.environ["KERNELS_NEURON_SIM_COMPILED"] == "1":  # asked for: run on the build or not at all
    from kernels_neuron import compiled_sim

    if not compiled_sim.is_built():
        raise RuntimeError(
            "KERNELS_NEURON_SIM_COMPILED=1: no compiled build of the current sources; run kernels-neuron compile-sim"
        )
