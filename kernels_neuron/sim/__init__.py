"""A CPU simulator of AWS's NKI (Neuron Kernel Interface) for Trainium.

It implements the public ``nki`` API (``nki.jit``, ``nki.simulate``, ``nki.language``,
``nki.isa``) on NumPy, checks every instruction against the NeuronCore's rules, tracks SBUF and
PSUM capacity, and records an instruction trace for the cost model. This package depends only
on NumPy and ml_dtypes (torch is optional), so it can ship on its own.

>>> from kernels_neuron import sim
>>> backend = sim.install()              # ``import nki`` now works (the simulator, without real NKI)
>>> import numpy as np, nki, nki.language as nl, nki.isa as nisa
>>> @nki.jit
... def double(x):
...     tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
...     nisa.dma_copy(dst=tile, src=x)
...     nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=2.0)
...     out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
...     nisa.dma_copy(dst=out, src=tile)
...     return out
>>> double(np.ones((4, 8), np.float32))[0, :3]
array([2., 2., 2.], dtype=float32)
>>> result = sim.run(double, np.ones((4, 8), np.float32))
>>> [i.op for i in result.trace]
['dma_copy', 'tensor_scalar', 'dma_copy']

For cost modelling, ``sim.run(..., numerics=False)`` records the same trace without the arithmetic
(a trace-only run: no outputs; see :func:`run`):

>>> traced = sim.run(double, np.ones((4, 8), np.float32), numerics=False)
>>> traced.outputs is None and traced.trace.instructions == result.trace.instructions
True
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from . import collectives, isa, language
from .errors import (
    AccumulateOntoNonMatmulWarning,
    AccumulateUninitializedWarning,
    AliasingError,
    CapacityError,
    CapacityWarning,
    NkiValidationError,
    NoActiveKernel,
    UncomputedValueError,
)
from .jit import Kernel, SimResult, capture, jit, run, run_ranks, simulate
from .targets import TARGETS, Target
from .trace import Instruction, Region, Trace

__all__ = [
    "install",
    "uninstall",
    "real_nki_available",
    "FORCE_ENV_VAR",
    "jit",
    "simulate",
    "run",
    "run_ranks",
    "capture",
    "Kernel",
    "SimResult",
    "Trace",
    "Instruction",
    "Region",
    "Target",
    "TARGETS",
    "NkiValidationError",
    "CapacityError",
    "CapacityWarning",
    "AliasingError",
    "AccumulateUninitializedWarning",
    "AccumulateOntoNonMatmulWarning",
    "UncomputedValueError",
    "NoActiveKernel",
    "isa",
    "language",
    "collectives",
]

FORCE_ENV_VAR = "KERNELS_NEURON_FORCE_SIM"
_MODULES = ("nki", "nki.language", "nki.isa", "nki.isa.constants", "nki.collectives", "nki.typing", "nki.dtype")


def real_nki_available() -> bool:
    """True when a real NKI (not PyPI's empty placeholder, not this simulator) is importable."""
    existing = sys.modules.get("nki")
    if existing is not None and getattr(existing, "__kernels_neuron_simulator__", False):
        return False
    if importlib.util.find_spec("nki") is None:
        return False
    try:
        language_module = importlib.import_module("nki.language")
    except ImportError:
        return False  # PyPI's placeholder package has no nki.language
    return hasattr(language_module, "ndarray")


def install(force: bool | None = None) -> str:
    """Make ``import nki`` resolve to the simulator unless a real NKI is present.

    Returns ``"neuron"`` when real NKI stays in place, ``"simulator"`` otherwise. Setting
    ``KERNELS_NEURON_FORCE_SIM=1`` (or ``force=True``) installs the simulator even over real NKI.
    """
    if force is None:
        force = os.environ.get(FORCE_ENV_VAR, "") not in ("", "0", "false", "False")
    current = sys.modules.get("nki")
    if current is not None and getattr(current, "__kernels_neuron_simulator__", False):
        return "simulator"
    if not force and real_nki_available():
        return "neuron"
    from .facade import build

    for name in _MODULES:
        sys.modules.pop(name, None)
    nki = build()
    sys.modules["nki"] = nki
    sys.modules["nki.language"] = language
    sys.modules["nki.isa"] = isa
    sys.modules["nki.isa.constants"] = isa.constants
    sys.modules["nki.collectives"] = collectives
    sys.modules["nki.typing"] = nki.typing
    sys.modules["nki.dtype"] = nki.dtype
    return "simulator"


def uninstall() -> None:
    """Remove the simulator from ``sys.modules`` (a later ``import nki`` finds whatever is installed)."""
    current = sys.modules.get("nki")
    if current is not None and getattr(current, "__kernels_neuron_simulator__", False):
        for name in _MODULES:
            sys.modules.pop(name, None)
