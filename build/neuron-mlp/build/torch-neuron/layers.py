"""Hub layers that replace transformers' gated MLP forwards (SwiGLU / GeGLU). Stateless: they
borrow the replaced module's projections and activation, and keep the signature of the forward
they replace. The activation is read from the module itself (``act_fn``, else ``activation_fn``),
so one layer serves SiLU models (Llama, Qwen, Mistral ...) and tanh-GELU ones (Gemma)."""

from __future__ import annotations

import torch
from torch import nn

from .mlp import activation_kind, describe_activation, gated_mlp


def _activation(module: nn.Module) -> str:
    act = getattr(module, "act_fn", None)
    if act is None:
        act = getattr(module, "activation_fn", None)
    kind = activation_kind(act)
    if kind is None:
        raise ValueError(f"gated_mlp: {type(module).__name__}: {describe_activation(act)}")
    return kind


def _weight(module: nn.Module, name: str) -> torch.Tensor:
    linear = getattr(module, name)
    if getattr(linear, "bias", None) is not None:  # kernelize never swaps these; a safety net for other routes
        raise ValueError(f"gated_mlp: {type(module).__name__}.{name} has a bias, which the kernel does not add")
    return linear.weight


class GatedMLP(nn.Module):
    """``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: LlamaMLP, Qwen2/3MLP, MistralMLP, Olmo2MLP,
    GraniteMLP, GemmaMLP, Gemma2/3MLP and any MLP whose forward is this."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, _weight(self, "gate_proj"), _weight(self, "up_proj"), _weight(self, "down_proj"),
                         _activation(self))


class GatedMLPFusedGateUp(nn.Module):
    """Phi3MLP: ``gate, up = gate_up_proj(x).chunk(2)``, then ``down_proj(up * activation_fn(gate))``."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gated_mlp(hidden_states, _weight(self, "gate_up_proj"), None, _weight(self, "down_proj"),
                         _activation(self))


__all__ = ["GatedMLP", "GatedMLPFusedGateUp"]
