"""The module object that stands in for ``nki`` when the simulator is installed."""

from __future__ import annotations

import types

from . import isa, language
from .jit import jit, simulate

__version__ = "0.6-sim"


def build() -> types.ModuleType:
    module = types.ModuleType("nki", "NKI (Neuron Kernel Interface) as run by the kernels-neuron CPU simulator.")
    module.jit = jit
    module.simulate = simulate
    module.language = language
    module.isa = isa
    module.__version__ = __version__
    module.__path__ = []  # a package, so ``import nki.language`` resolves through sys.modules
    module.__kernels_neuron_simulator__ = True
    return module
