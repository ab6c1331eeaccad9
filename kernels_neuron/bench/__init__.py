"""The microbenchmark machinery: run cases through the simulator and cost model, report them.

Cases are simulated trace-only (the cost model reads only the trace); ``check_numerics`` also
simulates each in full and checks the two traces are identical. The cases live in
:mod:`kernels_neuron.bench.suite` (imported on demand: it loads the kernels,
and with them ``nki``); this package runs them (:func:`run_suite`), renders the table, writes JSON
and draws the roofline plot. On a Trainium host (``torch.neuron`` present) each case is also timed
on the device next to the PyTorch computation it replaces (:func:`device_calls`).
"""

from __future__ import annotations

from .case import Case, Record
from .output import plot_roofline, render_table, write_json
from .runner import (
    NoMatchingCase,
    TraceMismatch,
    default_jobs,
    device_available,
    device_calls,
    run_case,
    run_suite,
    torch_inputs,
    trace_difference,
)

__all__ = [
    "Case",
    "Record",
    "run_case",
    "run_suite",
    "device_available",
    "device_calls",
    "torch_inputs",
    "trace_difference",
    "TraceMismatch",
    "NoMatchingCase",
    "default_jobs",
    "render_table",
    "write_json",
    "plot_roofline",
]
