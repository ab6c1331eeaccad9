"""Shared test setup: the NKI simulator stands in for ``nki`` in every test process."""

from kernels_neuron import sim

sim.install()
