"""The modules of kinds the hub has no kernel for, so that the report says so rather than leave them out."""

from __future__ import annotations

import weakref

from torch import nn

from .attention import attention_modules
from .report import ReportRow

# Kinds of module the hub has no kernel for yet, by class name, so that the report can say so
# rather than leave them out: (what the name ends with, the kind, why).
_UNSERVED_KINDS = (
    ("LayerNorm", "LayerNorm", "the hub's LayerNorm kernel serves torch.nn.LayerNorm and CohereLayerNorm only"),
    ("Experts", "MoE experts", "not MixtralExperts' forward, the only experts form the hub's MoE kernel serves"),
    (
        "MLP",
        "MLP",
        "neither a gated MLP down(act(gate(x)) * up(x)) nor a plain one down(act(up(x))), the MLPs the hub has kernels for",
    ),
)


def without_kernel(model: nn.Module, candidates: set[int], attention: bool) -> list[ReportRow]:
    """Report rows for the modules of kinds the hub has no kernel for (or a form it does not take), and
    for attention modules kernelize cannot route."""
    rows = []
    routed = {id(m) for _, m in attention_modules(model)} if attention else set()
    for path, module in model.named_modules():
        if id(module) in candidates or id(module) in routed:
            continue
        name = type(module).__name__
        kind = next(((k, why) for suffix, k, why in _UNSERVED_KINDS if name.endswith(suffix)), None)
        if kind is None and isinstance(module, nn.LayerNorm):
            kind = ("LayerNorm", _UNSERVED_KINDS[0][2])
        if kind is None and attention and name.endswith("Attention"):
            kind = (
                "attention",
                "not routed: its model does not call transformers' AttentionInterface for it, and no layer of the "
                "hub replaces its forward (the hub has one for FalconAttention only)",
            )
        if kind is not None:
            rows.append(
                ReportRow(path or "<model>", kind[0], "-", "no kernel", f"{name}: {kind[1]}", weakref.ref(module))
            )
    return rows
