"""Shared test setup: the NKI simulator stands in for ``nki`` in every test process."""

import os

# One thread per process for OpenMP and OpenBLAS, set before NumPy or torch load (and inherited by the
# subprocesses tests start): the tiny models here gain nothing from a second thread, while NumPy's and
# torch's pools fight each other for a 2-core machine's cores (a third of the suite's CPU time).
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

from kernels_neuron import sim  # noqa: E402

sim.install()

import torch  # noqa: E402

# One intra-op thread: on a 2-core machine torch's default pool makes the many tiny model calls
# here far slower whenever another process holds a core.
torch.set_num_threads(1)
