"""Hub layers that replace transformers' RMSNorm forwards. Stateless: they borrow the replaced
module's ``weight`` and epsilon, and keep the signature of the forward they replace.

A layer accepts whatever the module it replaces accepted, so it makes its input contiguous
(Gemma3 normalises transposed q/k views); the op itself rejects non-contiguous input. Each call
re-checks what ``unsupported_reasons`` checks (dtypes, hidden size, the weight's shape), which
kernelize also asks before swapping: a module that no longer fits (``model.double()``, a weight
replaced by a DTensor) runs its own forward, with the reason on the module and a warning once."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from ._backend import input_reasons, own_forward, tensor_reasons
from .rmsnorm import MAX_HIDDEN, MIN_HIDDEN, rms_norm

# Each layer: the module attribute holding epsilon and the rms_norm convention it computes.
_LAYERS = {
    "RMSNorm": ("variance_epsilon", "llama"),
    "GemmaRMSNorm": ("eps", "gemma"),
    "RMSNormFP32Multiply": ("variance_epsilon", "fp32_multiply"),
}
LIMITS = (
    f"a 1-D weight of hidden size {MIN_HIDDEN}..{MAX_HIDDEN}; float32, bfloat16 or float16 input and weight; "
    "the epsilon attribute the layer reads"
)


def unsupported_reasons(layer: str, module: nn.Module, x: torch.Tensor | None = None) -> list[str]:
    """Why ``module`` cannot run ``layer`` (empty when it can); with ``x``, also for that input."""
    name = type(module).__name__
    epsilon, _ = _LAYERS[layer]
    reasons = [] if hasattr(module, epsilon) else [f"{name} has no attribute {epsilon!r}"]
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return reasons + [f"{name}.weight is not a tensor"]
    if weight.dim() != 1:
        return reasons + [f"weight of shape {tuple(weight.shape)} is not 1-D"]
    hidden = weight.shape[0]
    if not MIN_HIDDEN <= hidden <= MAX_HIDDEN:
        reasons.append(f"hidden size {hidden} is outside the kernel's {MIN_HIDDEN}..{MAX_HIDDEN}")
    reasons += tensor_reasons("weight", weight)
    if x is not None:
        reasons += input_reasons(x, hidden)
    return reasons


def _forward(layer: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    reasons = unsupported_reasons(layer, module, x)
    if reasons:
        return own_forward(module, "; ".join(reasons), x)
    epsilon, convention = _LAYERS[layer]
    weight = cast(torch.Tensor, module.weight)  # unsupported_reasons checked it is one
    return rms_norm(x.contiguous(), weight, getattr(module, epsilon), convention)


class RMSNorm(nn.Module):
    """Llama-style (Llama, Qwen2/3, Mistral, Mixtral, Phi3, Granite ...): normalise, cast, then scale."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _forward("RMSNorm", self, hidden_states)


class GemmaRMSNorm(nn.Module):
    """Gemma/Gemma2/Gemma3: ``(1 + weight)`` in fp32, then cast to the input dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _forward("GemmaRMSNorm", self, x)


class RMSNormFP32Multiply(nn.Module):
    """OLMo2-style: scale by the weight in fp32, then cast to the input dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _forward("RMSNormFP32Multiply", self, hidden_states)


__all__ = ["RMSNorm", "GemmaRMSNorm", "RMSNormFP32Multiply"]
