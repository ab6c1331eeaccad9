"""Shared test setup: the NKI simulator stands in for ``nki`` in every test process."""

from kernels_neuron import sim

sim.install()

import sys
from pathlib import Path

# ``benchmarks/`` (the suite and the calibration kernels) is imported by tests from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

# One intra-op thread: on a 2-core machine torch's default pool makes the many tiny model calls
# here far slower whenever another process holds a core.
torch.set_num_threads(1)
