"""The ``layers`` module of the neuron-flash-attn Hub repo: a layer for attention modules that bypass
transformers' attention interface.

Most models reach the kernel through their attention function (``attn_implementation=
"kernels-neuron/neuron-flash-attn"``, or ``kernels_neuron.kernelize``, which registers
``flash_attn_forward`` with transformers' ``AttentionInterface``), so they need no layer class.
Falcon's model does not: ``FalconAttention.forward`` calls torch's ``scaled_dot_product_attention``
itself. The ``FalconAttention`` layer replaces that forward for Falcon's rotary models. Stateless, it
borrows the module's ``query_key_value`` and ``dense`` projections and computes what the module's
rotary path computes:

- the fused projection split into query, key and value for each of Falcon's layouts (the new decoder
  architecture's ``num_kv_heads`` groups, multi-query's single KV head, or one KV head per query
  head), with the KV heads kept as they are: the kernel reads each KV head once for all its query
  heads, where the module broadcasts them to every query head first;
- rotary embeddings (the modeling module's own ``apply_rotary_pos_emb``), the KV cache update, and
  ``flash_attn_forward`` (what the attention-interface route calls) on the mask the model passes:
  transformers' sdpa keep-mask (padding runs as packed sequences there) or the eager additive mask;
  None means causal for more than one query, as for the module's sdpa call;
- the ``dense`` projection. The rotary path applies no attention dropout, in training either, so
  neither does the layer.

The KV cache holds the KV heads too (``num_kv_heads`` for the new decoder architecture, where the
module's own forward stores them broadcast to every query head); a cache the module's own forward
started is continued in its layout. ALiBi models, ``output_attentions=True``, head sizes above the
kernel's limit and masks other than these run the module's own forward for that call
(``unsupported_reasons``, asked by ``kernelize`` and again on every call), with the reason kept on the
module. A fallback call that would continue a cache the layer filled for the new decoder architecture
(fewer heads than its own forward writes) is refused with an error saying so.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ._backend import is_dtensor, own_forward, tensor_reasons
from .attention import MAX_HEAD_DIM
from .flash_attn_interface import flash_attn_forward

_FALCON_FORWARD = "FalconAttention.forward"  # the forward the layer reproduces
_ATTRIBUTES = (
    "query_key_value",
    "dense",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "new_decoder_architecture",
    "multi_query",
    "is_causal",
    "layer_idx",
    "config",
)
LIMITS = {
    "FalconAttention": (
        f"FalconAttention's own forward with rotary positions (not ALiBi); head_dim up to {MAX_HEAD_DIM}; "
        "float32, bfloat16 or float16 input; no output_attentions; the model's sdpa or eager mask"
    ),
}


def _rotary(module: nn.Module) -> Any:
    """The modeling module's ``apply_rotary_pos_emb``, which the module's forward calls (None if absent)."""
    return getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)


def _module_reasons(module: Any) -> list[str]:  # Any: read by the attributes FalconAttention sets
    name = type(module).__name__
    modeling = sys.modules.get(type(module).__module__)
    falcon_attention = getattr(modeling, "FalconAttention", None)
    if falcon_attention is None or type(module).forward is not falcon_attention.forward:
        return [f"{name}'s forward is not the {_FALCON_FORWARD} the layer reproduces"]
    missing = [a for a in _ATTRIBUTES if not hasattr(module, a)]
    if missing:
        return [f"{name} has no attribute(s) {missing}"]
    if _rotary(module) is None:
        return [f"{type(module).__module__} has no apply_rotary_pos_emb"]
    reasons = []
    if getattr(module.config, "alibi", False):
        reasons.append("ALiBi positions (config.alibi=True): the kernel takes no ALiBi bias")
    if module.head_dim > MAX_HEAD_DIM:
        reasons.append(f"head_dim {module.head_dim} is above the kernel's limit of {MAX_HEAD_DIM}")
    if module.new_decoder_architecture and module.num_heads % module.num_kv_heads:
        reasons.append(f"{module.num_heads} query heads are not a multiple of {module.num_kv_heads} KV heads")
    if not module.new_decoder_architecture and not module.multi_query and module.num_kv_heads != module.num_heads:
        reasons.append(
            f"num_kv_heads {module.num_kv_heads} differs from num_heads {module.num_heads} in the layout with a "
            "KV head per query head"
        )
    weight = getattr(module.query_key_value, "weight", None)
    if is_dtensor(weight):
        reasons.append("query_key_value.weight is a DTensor (sharded or replicated across ranks)")
    return reasons


def unsupported_reasons(
    layer: str,
    module: nn.Module,
    x: torch.Tensor | None = None,
    *,
    alibi: torch.Tensor | None = None,
    attention_mask: Any = None,
    output_attentions: bool = False,
) -> list[str]:
    """Why ``module`` cannot run ``layer`` (empty when it can); with ``x`` and the call's other arguments,
    also why it cannot serve that call."""
    reasons = _module_reasons(module)
    if x is None:
        return reasons
    reasons += tensor_reasons("the input", x)
    if alibi is not None:
        reasons.append("an ALiBi tensor was passed: the kernel takes no ALiBi bias")
    if output_attentions:
        reasons.append("output_attentions=True: the kernel does not return attention weights")
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4):
        form = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        reasons.append(
            f"attention_mask {form} is not the 4-D sdpa or eager mask FalconAttention's forward takes "
            "(the model's attention implementation is neither)"
        )
    return reasons


def _split_heads(module: Any, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection ``[B, S, ...]`` as query ``[B, H, S, D]`` and key/value ``[B, Hkv, S, D]``."""
    batch, seq, _ = fused.shape
    heads, d = module.num_heads, module.head_dim
    if module.new_decoder_architecture:  # per KV group: its query heads, then its key, then its value
        groups = fused.view(batch, seq, module.num_kv_heads, heads // module.num_kv_heads + 2, d)
        query = groups[:, :, :, :-2].reshape(batch, seq, heads, d)
        key, value = groups[:, :, :, -2], groups[:, :, :, -1]
    elif module.multi_query:  # every query head, then the one key and value
        split = fused.view(batch, seq, heads + 2, d)
        query, key, value = split[:, :, :-2], split[:, :, -2:-1], split[:, :, -1:]
    else:  # per head: query, key, value
        split = fused.view(batch, seq, heads, 3, d)
        query, key, value = split[..., 0, :], split[..., 1, :], split[..., 2, :]
    return query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)


def _cached_heads(cache: Any, layer_idx: int) -> int | None:
    """How many KV heads the cache already holds for this layer (None: nothing cached yet)."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list) or not 0 <= layer_idx < len(layers):
        return None
    keys = getattr(layers[layer_idx], "keys", None)
    if not getattr(layers[layer_idx], "is_initialized", False) or not isinstance(keys, torch.Tensor):
        return None
    return keys.shape[1] if keys.dim() == 4 and keys.numel() else None


def _check_own_forward_can_continue(module: Any, cache: Any, reason: str) -> None:
    """A clear error, rather than torch's from inside the cache, when the module's own forward (new decoder
    architecture: KV heads broadcast to every query head) would append to a cache the layer filled."""
    cached = _cached_heads(cache, module.layer_idx)
    if cached is not None and cached != module.num_heads:
        raise ValueError(
            f"{type(module).__name__} (layer {module.layer_idx}): this call runs the module's own forward "
            f"({reason}), which caches {module.num_heads} KV heads, but the KV cache holds {cached} (filled by "
            "kernels-neuron's FalconAttention layer, which caches the model's num_kv_heads); use one cache per "
            "route, e.g. the same output_attentions for every call that shares a cache"
        )


class FalconAttention(nn.Module):
    """Falcon's rotary attention on the NKI flash-attention kernel (see the module docstring)."""

    can_torch_compile = True
    has_backward = True

    def forward(
        self,
        hidden_states: torch.Tensor,
        alibi: torch.Tensor | None,
        attention_mask: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        layer_past: Any = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        reasons = unsupported_reasons(
            "FalconAttention",
            self,
            hidden_states,
            alibi=alibi,
            attention_mask=attention_mask,
            output_attentions=output_attentions,
        )
        if reasons:
            if layer_past is not None and self.new_decoder_architecture:
                _check_own_forward_can_continue(self, layer_past, "; ".join(reasons))
            return own_forward(
                self,
                "; ".join(reasons),
                hidden_states,
                alibi,
                attention_mask,
                position_ids=position_ids,
                layer_past=layer_past,
                use_cache=use_cache,
                output_attentions=output_attentions,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        if position_embeddings is None:
            raise ValueError(f"{type(self).__name__}: position_embeddings (cos, sin) are needed without ALiBi")
        module: Any = self  # the FalconAttention module whose forward this is
        cos, sin = position_embeddings
        batch, seq, _ = hidden_states.shape
        query, key, value = _split_heads(module, module.query_key_value(hidden_states))
        query, key = _rotary(module)(query, key, cos, sin)
        if layer_past is not None:
            cached = _cached_heads(layer_past, module.layer_idx)
            if cached is not None and cached != key.shape[1]:  # started by the module's own forward: broadcast
                key = key.repeat_interleave(cached // key.shape[1], dim=1)
                value = value.repeat_interleave(cached // value.shape[1], dim=1)
            key, value = layer_past.update(key, value, module.layer_idx)
        out, _ = flash_attn_forward(module, query, key, value, attention_mask, is_causal=module.is_causal)
        return module.dense(out.reshape(batch, seq, module.num_heads * module.head_dim)), None


__all__ = ["FalconAttention"]
