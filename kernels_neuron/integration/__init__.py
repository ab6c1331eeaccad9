"""``kernelize(model, device="neuron")``: swap the registry's NKI layers into a transformers model.

It works through the kernels library itself (so it does not depend on transformers' kernels gate):
it hooks the model's layer classes with ``kernels.replace_kernel_forward_from_hub`` (by class name
where transformers does not decorate the class, or decorates it with a name whose numerics differ),
with each layer plug-in's checks as the per-module condition, registers the registry's mapping, calls
``kernels.kernelize``, routes attention through transformers' attention interface, and reports, per
module considered, whether it was swapped, kept its own forward and why, or has no kernel.

The package, by concept:

- ``modes``: "inference" / "training" (+ "torch.compile") as the kernels library's ``Mode``;
- ``repos``: where the repos load from (the shipped ``build/`` through ``LOCAL_KERNELS``, else the
  Hub), and each layer's plug-in module (``unsupported_reasons``, ``LIMITS``, ``computes``);
- ``layers``: hooking the registry's classes (also in transformers' modeling modules as they are
  imported, for ``use_kernels=True``), the candidates in a model, ``register_mapping``;
- ``attention``: the dispatcher registered with ``AttentionInterface``, ``register_attention``;
- ``unserved``: modules of kinds the hub has no kernel for, for the report;
- ``report``: ``KernelizeReport`` and its rows;
- ``kernelize``: the function that ties them together.

Nothing here knows a kernel's limits: each layer's module answers for its kernel.
"""

from .attention import register_attention
from .kernelize import kernelize
from .layers import register_mapping
from .modes import resolve_mode
from .report import KernelizeReport, ReportRow
from .repos import layer_limits

__all__ = [
    "KernelizeReport",
    "ReportRow",
    "kernelize",
    "layer_limits",
    "register_attention",
    "register_mapping",
    "resolve_mode",
]
