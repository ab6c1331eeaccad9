"""Attention: routed through transformers' attention interface, not swapped as a layer.

transformers tags no attention class: each attention module calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. kernelize registers a dispatcher there (and
transformers' sdpa mask in ``ALL_MASK_ATTENTION_FUNCTIONS`` under the same name; without it padded
batches would silently get no mask) and switches the model to that name. The dispatcher asks the kernel
package, per call, whether it can serve the module and the call (``unsupported_reasons``) and otherwise
runs the model's own attention (sdpa, or eager where sdpa cannot: softcap, sinks, an eager model),
recording why on the module.

Attention classes whose forward calls no attention function (FalconAttention calls sdpa itself) cannot be
routed; the registry maps those to a layer of the attention repo instead (``ops/attention_layers.py``),
swapped like any other layer, and ``unserved`` reports the rest as not routed.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any, cast

import kernels
from kernels import Mode
from torch import nn

from .. import registry as registry_module
from ..hub.loading import check_before_loading
from ..ops._backend import FALLBACK_ATTRIBUTE, record_fallback
from ..registry import Registry
from .modes import MODE_NAMES, mode_name
from .report import ReportRow
from .repos import ensure_local_kernels, pinned_version

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION_LAYER = "attention"
_ORIGINAL_ATTENTION = "_kernels_neuron_original_attention"  # set on each attention module by kernelize


def _load_attention_kernel(reg: Registry, name: str) -> Any:
    entry = next(e for e in reg.attention if e.name == name)
    return kernels.get_kernel(reg.repo_id(entry.repo), **pinned_version(reg, entry.repo))


def _bool_mask_as_additive(mask: Any, dtype: Any) -> Any:
    import torch

    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(
        mask,
        torch.zeros((), dtype=dtype, device=mask.device),
        torch.full((), torch.finfo(dtype).min, dtype=dtype, device=mask.device),
    )


def _own_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """The model's own attention for a module the kernel does not serve, given an sdpa-style mask."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    original = getattr(module, _ORIGINAL_ATTENTION, "sdpa")
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    needs_eager = original == "eager" or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None
    if eager is None or not needs_eager:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    sq, sk = query.shape[2], key.shape[2]
    is_causal = kwargs.pop("is_causal", None)
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if attention_mask is None and is_causal and sq > 1:  # sdpa's is_causal (top-left), as a mask for eager
        attention_mask = torch.ones(sq, sk, dtype=torch.bool, device=query.device).tril()[None, None]
    return eager(module, query, key, value, _bool_mask_as_additive(attention_mask, query.dtype), **kwargs)


def _attention_dispatcher(kernel: Any):
    def kernels_neuron_attention(
        module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
    ):
        reasons = kernel.unsupported_reasons(module, module.training, query, key, value, dropout, kwargs.get("s_aux"))
        if reasons:
            record_fallback(module, "; ".join(reasons))
            return _own_attention(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                is_causal=is_causal,
                **kwargs,
            )
        return kernel.flash_attn_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )

    return kernels_neuron_attention


def register_attention(reg: Registry | None = None) -> list[str]:
    """Register the registry's attention functions with transformers (``AttentionInterface`` and, with
    transformers' sdpa mask, ``AttentionMaskInterface``); returns their names. After this,
    ``attn_implementation="kernels_neuron_attention"`` works in ``from_pretrained``/``from_config``."""
    return list(_register_attention(reg or registry_module.load()))


def _register_attention(reg: Registry) -> dict[str, Any]:
    """``register_attention``'s work; returns the loaded kernel of each registered name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    ensure_local_kernels(reg)
    check_before_loading(reg)
    loaded = {}
    for entry in reg.attention:
        loaded[entry.name] = _load_attention_kernel(reg, entry.name)
        AttentionInterface.register(entry.name, _attention_dispatcher(loaded[entry.name]))
        AttentionMaskInterface.register(entry.name, sdpa_mask)
    return loaded


def restore_own_attention(model: nn.Module, reg: Registry) -> None:
    """``attention=False`` on a model an earlier kernelize routed: back to the attention it had before."""
    names = {entry.name for entry in reg.attention}
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) in names:  # a transformers model an earlier call routed
        originals = {getattr(m, _ORIGINAL_ATTENTION, "sdpa") for _, m in attention_modules(model)}
        cast("PreTrainedModel", model).set_attn_implementation(originals.pop() if len(originals) == 1 else "sdpa")


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers attention modules that call the function AttentionInterface holds for their config."""
    found = []
    for path, module in model.named_modules():
        modeling = sys.modules.get(type(module).__module__)
        if (
            type(module).__name__.endswith("Attention")
            and hasattr(module, "config")
            and modeling is not None
            and hasattr(modeling, "ALL_ATTENTION_FUNCTIONS")
        ):
            found.append((path or "<model>", module))
    return found


def kernelize_attention(model: nn.Module, reg: Registry, requested: Mode) -> list[ReportRow]:
    modules = attention_modules(model)
    if not reg.attention or not modules:
        return []
    entry = reg.attention[0]
    kernel_label = f"{reg.repo_id(entry.repo)}:{entry.function}"
    training = Mode.TRAINING in requested

    def rows(reason: str | None, kernel: Any = None) -> list[ReportRow]:
        out = []
        for path, module in modules:
            reasons = [reason] if reason else kernel.unsupported_reasons(module, training=training)
            out.append(
                ReportRow(
                    path,
                    ATTENTION_LAYER,
                    kernel_label,
                    "fallback" if reasons else "swapped",
                    "; ".join(reasons),
                    weakref.ref(module),
                )
            )
        return out

    wanted = [name for name, flag in MODE_NAMES.items() if flag in requested]
    missing = [name for name in wanted if name not in entry.modes]
    if missing:
        return rows(f"mode {mode_name(requested)} is not among the attention function's modes {list(entry.modes)}")
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return rows(f"{type(model).__name__} does not let transformers set its attention implementation")
    kernel = _register_attention(reg)[entry.name]
    transformers_model = cast("PreTrainedModel", model)  # it lets transformers set its attention
    original = transformers_model.config._attn_implementation
    for _, module in modules:
        vars(module).pop(FALLBACK_ATTRIBUTE, None)
        if not hasattr(module, _ORIGINAL_ATTENTION):  # kernelizing twice keeps the model's own
            setattr(module, _ORIGINAL_ATTENTION, original if original in ("sdpa", "eager") else "sdpa")
    transformers_model.set_attn_implementation(entry.name)
    return rows(None, kernel)
