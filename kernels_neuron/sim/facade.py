"""The module object that stands in for ``nki`` when the simulator is installed."""

from __future__ import annotations

import types

from . import isa, language
from .jit import jit, simulate

__version__ = "0.6-sim"


def build() -> types.ModuleType:
    module = types.ModuleType("nki", "NKI (Neuron Kernel Interface) as run by the kernels-neuron CPU simulator.")
    # A module's attributes are its namespace; ModuleType declares none of these, so set them there.
    vars(module).update(
        jit=jit,
        simulate=simulate,
        language=language,
        isa=isa,
        __version__=__version__,
        __path__=[],  # a package, so ``import nki.language`` resolves through sys.modules
        __kernels_neuron_simulator__=True,
    )
    return module
