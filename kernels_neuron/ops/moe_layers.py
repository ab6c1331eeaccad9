"""Hub layer that replaces transformers' MoE experts forward (``MixtralExperts`` and the 50-odd classes
whose forward is the same: Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE, GLM-4-MoE ...). Stateless: it borrows the
module's ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I] and ``act_fn``, and keeps the forward's
signature ``(hidden_states, top_k_index, top_k_weights)``; the router stays the model's.

What the module computes is read from its class's forward (through transformers'
``use_experts_implementation`` wrapper): it must be MixtralExperts' forward statement for statement
(:func:`computes`), so a class that looks alike but computes otherwise keeps its own. GPT-OSS's experts
do not qualify: they store the weights transposed ([E, H, 2I]), interleave gate and up columns, add
biases, clamp, and use ``(up + 1) * gate * sigmoid(alpha * gate)``.

Anything else the kernel cannot take (a dtype, a size past its limits, non-contiguous or DTensor
weights) makes the module run its own forward for that call, with the
reason kept on the module and warned about once.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import sys

import torch
from torch import nn

from ._backend import autocast_dtype, dtype_name, own_forward, tensor_reasons
from .mlp import activation_kind, describe_activation
from .mlp_structure import forward_definition
from .moe import MAX_INTERMEDIATE, max_hidden, moe_experts

LIMITS = (
    f"a forward computing MixtralExperts' (read from its source); gate_up_proj [E, 2I, H] and down_proj "
    f"[E, H, I] plain contiguous parameters; hidden size up to {max_hidden('bfloat16')} (bf16/fp16) or "
    f"{max_hidden('float32')} (fp32) in the compute dtype; intermediate size up to {MAX_INTERMEDIATE}; "
    "SiLU or tanh-GELU activation"
)


def _unwrapped(function: object) -> object:
    """The function transformers' ``use_experts_implementation`` wrapped (``functools.wraps``), or itself."""
    return inspect.unwrap(function)  # type: ignore[arg-type]


@functools.cache
def _forward_tree(function: object) -> str | None:
    """The forward's statements, as an AST dump (no docstring), or None when its source is unavailable."""
    definition = forward_definition(function)
    if definition is None:
        return None
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def _reference_tree() -> str | None:
    """MixtralExperts' forward, the computation the layer reproduces. transformers is no dependency of the
    repo: while it is not loaded, there is no transformers experts class to compare either (nothing is
    cached then, so a later call finds it)."""
    if "transformers" not in sys.modules:
        return None
    module = importlib.import_module("transformers.models.mixtral.modeling_mixtral")
    return _forward_tree(_unwrapped(module.MixtralExperts.forward))


def computes(layer: str, cls: type) -> bool:
    """Whether ``cls.forward`` (under transformers' experts wrapper) is MixtralExperts' forward."""
    reference = _reference_tree()
    return reference is not None and _forward_tree(_unwrapped(getattr(cls, "forward", None))) == reference


def _reasons(module: nn.Module, x: torch.Tensor | None, top_k_index: torch.Tensor | None) -> list[str]:
    name = type(module).__name__
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    act = getattr(module, "act_fn", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return [f"{name} has no gate_up_proj and down_proj weight tensors"]
    reasons = [r for n, t in (("gate_up_proj", gate_up), ("down_proj", down)) for r in tensor_reasons(f"{name}.{n}", t)]
    if reasons:
        return reasons
    if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        return [f"{name} stores transposed weights or has biases (the kernel takes MixtralExperts' layout)"]
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape != (down.shape[0], 2 * down.shape[2], down.shape[1]):
        return [
            f"{name}'s weights gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
            "[E, 2I, H] and [E, H, I]"
        ]
    if activation_kind(act) is None:
        reasons.append(f"{name}.act_fn: {describe_activation(act)}")
    if gate_up.dtype != down.dtype:
        reasons.append(f"{name}'s weights have mixed dtypes {dtype_name(gate_up.dtype)} and {dtype_name(down.dtype)}")
    compute = gate_up.dtype
    if x is not None:
        reasons += tensor_reasons("the input", x)
        if x.dim() != 2 or x.numel() == 0:
            reasons.append(f"the input of shape {tuple(x.shape)} is not [tokens >= 1, hidden]")
        compute = autocast_dtype(x) or x.dtype
        if autocast_dtype(x) is None and x.dtype != gate_up.dtype:
            reasons.append(f"the input's dtype {x.dtype} differs from the weights' {gate_up.dtype}")
    if top_k_index is not None and (top_k_index.dim() != 2 or top_k_index.dtype not in (torch.int64, torch.int32)):
        reasons.append(f"top_k_index of shape {tuple(top_k_index.shape)} ({top_k_index.dtype}) is not [tokens, k] int")
    _, hidden, inter = down.shape
    if compute in (torch.float32, torch.bfloat16, torch.float16) and hidden > max_hidden(dtype_name(compute)):
        reasons.append(
            f"hidden size {hidden} is above the kernel's {max_hidden(dtype_name(compute))} for {dtype_name(compute)}"
        )
    if inter > MAX_INTERMEDIATE:
        reasons.append(f"intermediate size {inter} is above the kernel's {MAX_INTERMEDIATE}")
    reasons += [
        f"{name}.{n} is not contiguous"
        for n, t in (("gate_up_proj", gate_up), ("down_proj", down))
        if not t.is_contiguous()
    ]
    return reasons


def unsupported_reasons(layer: str, module: nn.Module, x: torch.Tensor | None = None) -> list[str]:
    """Why ``module`` cannot run ``layer`` (empty when it can); with ``x``, also for that input."""
    if not computes(layer, type(module)):
        return [f"{type(module).__name__}.forward is not MixtralExperts' computation (the layer's)"]
    return _reasons(module, x, None)


class MoEExperts(nn.Module):
    """``MixtralExperts.forward``: each token's k chosen experts' SwiGLU/GeGLU, weighted and summed, in
    one grouped NKI launch (MixtralExperts, Qwen2/3MoeExperts, DeepseekV2/V3Experts, OlmoeExperts and
    every experts class whose forward is MixtralExperts')."""

    can_torch_compile = True
    has_backward = True

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        reasons = _reasons(self, hidden_states, top_k_index)
        if reasons:
            return own_forward(self, "; ".join(reasons), hidden_states, top_k_index, top_k_weights)
        kind = activation_kind(self.act_fn)
        gate_up, down = self.gate_up_proj, self.down_proj
        assert kind is not None and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)  # _reasons
        return moe_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, kind)


__all__ = ["MoEExperts"]
