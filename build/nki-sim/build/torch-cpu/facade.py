"""The module object that stands in for ``nki`` when the simulator is installed."""

from __future__ import annotations

import types

from . import collectives, dtypes, isa, language, nki_typing
from .jit import jit, simulate

__version__ = "0.6-sim"


# The dtypes AWS documents (``nki.language``'s Data Types), also reachable as ``nki.dtype.<name>``.
DOCUMENTED_DTYPES = (
    "bool_",
    "int8",
    "int16",
    "int32",
    "uint8",
    "uint16",
    "uint32",
    "float16",
    "float32",
    "bfloat16",
    "tfloat32",
    "float8_e4m3",
    "float8_e5m2",
    "float8_e4m3fn",
    "float8_e8m0fnu",
    "float8_e5m2_x4",
    "float8_e4m3fn_x4",
    "float4_e2m1fn_x4",
)


def build_dtype_module() -> types.ModuleType:
    """``nki.dtype``: the NKI dtypes (NumPy dtypes where NumPy has one, usable as ``np.zeros(dtype=...)``)."""
    module = types.ModuleType("nki.dtype", "NKI data types.")
    vars(module).update({name: getattr(dtypes, name) for name in DOCUMENTED_DTYPES})
    return module


def build() -> types.ModuleType:
    module = types.ModuleType("nki", "NKI (Neuron Kernel Interface) as run by the kernels-neuron CPU simulator.")
    # A module's attributes are its namespace; ModuleType declares none of these, so set them there.
    vars(module).update(
        jit=jit,
        simulate=simulate,
        language=language,
        isa=isa,
        collectives=collectives,
        typing=nki_typing,
        dtype=build_dtype_module(),
        __version__=__version__,
        __path__=[],  # a package, so ``import nki.language`` resolves through sys.modules
        __kernels_neuron_simulator__=True,
    )
    return module
