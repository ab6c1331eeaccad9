"""kernels-neuron: NKI kernels for AWS Trainium in the Hugging Face Kernels Hub format.

- ``kernels_neuron.sim``: the CPU NKI simulator (``sim.install()`` makes ``import nki`` work);
- ``kernels_neuron.cost``: the Trainium cost model (modelled, never measured, run times);
- ``kernels_neuron.ops``: the torch ops backed by the NKI kernels in ``nki_src/``;
- ``kernels_neuron.kernelize(model, device="neuron")``: swap the registry's layers into a model.
"""

from typing import Any

from . import compiled_sim as _compiled_sim

# Before any simulator module loads: its compiled build, where one of the current sources exists.
_compiled_sim.activate()

__version__ = "0.1.0"
__all__ = ["kernelize", "register_attention", "register_mapping"]


def __getattr__(name: str) -> Any:
    # Lazy: importing transformers/kernels is slow and the simulator alone needs neither.
    if name in ("kernelize", "register_attention", "register_mapping"):
        from . import integration

        return getattr(integration, name)
    raise AttributeError(f"module 'kernels_neuron' has no attribute {name!r}")
