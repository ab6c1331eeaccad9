"""Hub layers that replace transformers' RMSNorm forwards. Stateless: they borrow the replaced
module's ``weight`` and epsilon, and keep the signature of the forward they replace.

A layer accepts whatever the module it replaces accepted, so it makes its input contiguous
(Gemma3 normalises transposed q/k views); the op itself rejects non-contiguous input."""

from __future__ import annotations

import torch
from torch import nn

from .rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """Llama-style (Llama, Qwen2/3, Mistral, Mixtral, Phi3, Granite ...): normalise, cast, then scale."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states.contiguous(), self.weight, self.variance_epsilon, "llama")


class GemmaRMSNorm(nn.Module):
    """Gemma/Gemma2/Gemma3: ``(1 + weight)`` in fp32, then cast to the input dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.contiguous(), self.weight, self.eps, "gemma")


class RMSNormFP32Multiply(nn.Module):
    """OLMo2-style: scale by the weight in fp32, then cast to the input dtype."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states.contiguous(), self.weight, self.variance_epsilon, "fp32_multiply")


__all__ = ["RMSNorm", "GemmaRMSNorm", "RMSNormFP32Multiply"]
