"""Shared test setup: the NKI simulator stands in for ``nki`` in every test process."""

import gc
import os
from pathlib import Path

# One thread per process for OpenMP and OpenBLAS, set before NumPy or torch load (and inherited by the
# subprocesses tests start): the tiny models here gain nothing from a second thread, while NumPy's and
# torch's pools fight each other for a 2-core machine's cores (a third of the suite's CPU time).
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

# Collecting the tests imports torch, transformers and every test module: some 650,000 objects that live
# as long as the session. The cyclic garbage collector stays off while they are created (its full
# collections would traverse them again and again: about a quarter of the CPU an import of torch and
# transformers takes) and comes back on once they are frozen (pytest_collection_finish).
gc.disable()

from kernels_neuron import sim  # noqa: E402

sim.install()

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread: on a 2-core machine torch's default pool makes the many tiny model calls
# here far slower whenever another process holds a core.
torch.set_num_threads(1)

# Full collections once per 100 young-generation (gen 1) collections instead of 10. With the long-lived
# objects frozen (below), CPython's other condition for one (the old generation grew by a quarter since
# the last) holds almost always, so one came every 10 and traversed what each test file keeps alive
# (over the attention and MLP tests: 2.3 s of full collections, 0.8 s at 100). Cyclic garbage that
# outlives two young collections waits longer: memory only.
gc.set_threshold(*gc.get_threshold()[:2], 100)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The collector back on, with what collection created out of its reach (see pytest_runtest_setup)."""
    gc.collect()
    gc.freeze()
    gc.enable()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """At the start of each test file (a module's tests, or its docstrings' examples), before its
    fixtures: put what is alive then (torch, transformers, the test modules, session fixtures, caches:
    some 650,000 objects) out of the cyclic garbage collector's reach. Each of CPython's full
    collections traverses every tracked object, and over a session of many small model runs they took
    about a tenth of the CPU; what the tests create is collected as before. Frozen objects are still
    freed by reference counting (only a cycle among them would outlive its last reference), and nothing
    frozen is garbage then: collected just before."""
    global _frozen_for
    if item.path != _frozen_for:
        _frozen_for = item.path
        gc.collect()
        gc.freeze()


_frozen_for: Path | None = None
