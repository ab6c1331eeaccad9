"""The microbenchmark machinery: run cases through the simulator and cost model, report them.

The cases themselves live in the repository's ``benchmarks/`` folder (``benchmarks/suite.py``);
this package runs them (:func:`run_suite`), renders the table, writes JSON and draws the
roofline plot. On a Trainium host (``torch.neuron`` present) each case is also timed on the
device next to the PyTorch op it replaces.
"""

from __future__ import annotations

from .case import Case, Record
from .runner import device_available, run_case, run_suite
from .output import render_table, write_json, plot_roofline

__all__ = ["Case", "Record", "run_case", "run_suite", "device_available", "render_table", "write_json",
           "plot_roofline"]
