"""Hub layers that replace LayerNorm forwards: ``torch.nn.LayerNorm`` (GPT-NeoX, Starcoder2, Falcon,
Phi, GPT-2 ...) and Cohere's LayerNorm (no bias). Stateless: they borrow the replaced module's
``weight``, ``bias`` and epsilon, and keep the signature of the forward they replace.

A layer accepts whatever the module it replaces accepted, so it makes its input contiguous. Each call
re-checks what ``unsupported_reasons`` checks (the class, normalised shape, dtypes, sizes), which
kernelize also asks before swapping: a module that no longer fits runs its own forward, with the
reason on the module and a warning once."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._backend import input_reasons, own_forward, tensor_reasons
from .layernorm import MAX_HIDDEN, MIN_HIDDEN, hidden_limit, layer_norm

# Each layer: the module attribute holding epsilon, and whether the module has a bias attribute.
_LAYERS = {"LayerNorm": ("eps", True), "CohereLayerNorm": ("variance_epsilon", False)}
LIMITS = (
    f"torch.nn.LayerNorm over the last dim (with or without weight and bias), or Cohere's LayerNorm with a 1-D "
    f"weight; hidden size {MIN_HIDDEN}..{MAX_HIDDEN}, less where fp32 rows, weight and bias together need more "
    "SBUF than the smallest Trainium target has; float32, bfloat16 or float16 input, weight and bias, contiguous"
)


def _hidden_size(layer: str, module: nn.Module) -> tuple[int | None, list[str]]:
    """The normalised size, or why the module is not a LayerNorm the kernel computes."""
    name = type(module).__name__
    if layer == "LayerNorm":
        if type(module) is not nn.LayerNorm:  # matched by class name: only torch's own has its semantics
            return None, [f"{name} is not torch.nn.LayerNorm (a class of the same name with its own forward)"]
        shape = tuple(module.normalized_shape)
        if len(shape) != 1:
            return None, [f"normalized_shape {shape} spans more than the last dim"]
        return shape[0], []
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None, [f"{name}.weight is not a tensor"]
    if weight.dim() != 1:
        return None, [f"{name}.weight of shape {tuple(weight.shape)} is not 1-D (per-head q/k norms are not served)"]
    return weight.shape[0], []


def unsupported_reasons(layer: str, module: nn.Module, x: torch.Tensor | None = None) -> list[str]:
    """Why ``module`` cannot run ``layer`` (empty when it can); with ``x``, also for that input."""
    hidden, reasons = _hidden_size(layer, module)
    if hidden is None:
        return reasons
    epsilon, _ = _LAYERS[layer]
    if not isinstance(getattr(module, epsilon, None), float):
        reasons.append(f"{type(module).__name__} has no float attribute {epsilon!r}")
    for attribute in ("weight", "bias"):
        vector = getattr(module, attribute, None)
        if vector is None:
            continue
        if not isinstance(vector, torch.Tensor) or tuple(vector.shape) != (hidden,):
            reasons.append(f"{attribute} is not a tensor of shape ({hidden},)")
        else:
            reasons += tensor_reasons(attribute, vector)
            if not vector.is_contiguous():
                reasons.append(f"{attribute} is not contiguous")
    if x is not None:
        reasons += input_reasons(x, hidden)
        if not reasons:
            limit = hidden_limit(x, _vector(module, "weight"), _vector(module, "bias"))
            if hidden > limit:
                reasons.append(f"hidden size {hidden} is above the kernel's {limit} for these dtypes")
    elif hidden > MAX_HIDDEN:
        reasons.append(f"hidden size {hidden} is above the kernel's {MAX_HIDDEN}")
    return reasons


def _vector(module: nn.Module, attribute: str) -> torch.Tensor | None:
    value: Any = getattr(module, attribute, None)
    return value if isinstance(value, torch.Tensor) else None


def _forward(layer: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    reasons = unsupported_reasons(layer, module, x)
    if reasons:
        return own_forward(module, "; ".join(reasons), x)
    epsilon, has_bias = _LAYERS[layer]
    bias = _vector(module, "bias") if has_bias else None
    return layer_norm(x.contiguous(), _vector(module, "weight"), bias, getattr(module, epsilon))


class LayerNorm(nn.Module):
    """``torch.nn.LayerNorm`` over the last dim: fp32 statistics and affine, rounded once to the input dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.LayerNorm's own argument name
        return _forward("LayerNorm", self, input)


class CohereLayerNorm(nn.Module):
    """Cohere's LayerNorm: weight, no bias, fp32 compute, cast back to the input dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _forward("CohereLayerNorm", self, hidden_states)


__all__ = ["CohereLayerNorm", "LayerNorm"]
