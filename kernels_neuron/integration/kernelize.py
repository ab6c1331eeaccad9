"""``kernelize(model, device="neuron")``: the registry's NKI layers swapped into a model, attention routed,
and a report of every module considered."""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import kernels
from torch import nn

from .. import registry as registry_module
from ..ops._backend import FALLBACK_ATTRIBUTE
from ..registry import Registry
from .attention import kernelize_attention, restore_own_attention
from .layers import candidates as find_candidates
from .layers import hook, keeping_own_forward, register_mapping, swapped_to, violations
from .modes import mode_name, resolve_mode, supports
from .report import KernelizeReport, ReportRow
from .unserved import without_kernel

DEVICES = ("neuron", "cpu")  # the kernels-library device keys kernelize registers the hub's layers for
REPORT_ATTRIBUTE = "kernels_neuron_report"  # where kernelize leaves its KernelizeReport on the model
# The per-kernel keyword kernelize had before only=/exclude=, and the repo it stands for.
_MLP_KEYWORD_REPO = "neuron-mlp"


def _device_key(device: Any) -> str:
    """``device`` ("neuron", "cpu", "neuron:0", a torch.device) as the kernels-library key, or a clear error."""
    key = device.type if type(device).__name__ == "device" else device
    key = key.split(":", 1)[0] if isinstance(key, str) else key
    if key not in DEVICES:
        raise ValueError(
            f"kernelize: device {device!r} is not one kernels-neuron serves; use 'neuron' (Trainium, "
            "or its kernels on the CPU simulator where there is none) or 'cpu' (the simulator)"
        )
    return key


def _chosen_kernels(
    reg: Registry, only: Iterable[str] | None, exclude: Iterable[str] | None, attention: bool, mlp: bool
) -> set[str]:
    """The kernel repos kernelize may use: ``only`` (default all), minus ``exclude`` and what the
    ``attention=False`` / ``mlp=False`` keywords leave out."""
    kernel_repos = [name for name, repo in reg.repos.items() if repo.kind == "kernel"]
    for argument, names in (("only", only), ("exclude", exclude)):
        if isinstance(names, str):
            raise TypeError(f"kernelize: {argument} must be a list of kernel names, got the string {names!r}")
        unknown = sorted(set(names or ()) - set(kernel_repos))
        if unknown:
            raise ValueError(f"kernelize: {argument} names unknown kernels {unknown}; the kernels are {kernel_repos}")
    chosen = set(kernel_repos if only is None else only) - set(exclude or ())
    if not attention:
        chosen -= {entry.repo for entry in reg.attention}
    if not mlp:
        chosen.discard(_MLP_KEYWORD_REPO)
    return chosen


@contextlib.contextmanager
def _quiet_kernels_logging():
    """The kernels library warns about every layer name it has no mapping for (SiLU, rotary ...)
    and installs a root-logger handler; the report is our account of what happened, so keep
    its log at errors and leave the root logger as we found it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    kernels_log = logging.getLogger("kernels")
    previous = kernels_log.level
    kernels_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        kernels_log.setLevel(previous)
        root.handlers[:] = handlers
        root.setLevel(level)


def kernelize(
    model: nn.Module,
    device: str = "neuron",
    mode: Any = None,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    attention: bool = True,
    mlp: bool = True,
) -> nn.Module:
    """Swap kernels-neuron's NKI layers into ``model`` and attach ``model.kernels_neuron_report``.

    Args:
        model: a transformers (or any) model whose layer classes the registry names.
        device: the kernels-library device key the mapping is registered for: "neuron" (or "cpu"; also
            "neuron:0" or a ``torch.device``); the variant that loads is the system's (``torch-cpu``
            without Trainium).
        mode: None (from ``model.training``), a ``kernels.Mode``, or "inference", "training",
            "inference+torch.compile", "training+torch.compile".
        only: the kernels to use, by repo name ("neuron-rmsnorm", "neuron-layernorm", "neuron-mlp",
            "neuron-moe", "neuron-flash-attn"); default all.
        exclude: kernels not to use. A module of an excluded kernel keeps its own forward (or gets it
            back, if an earlier call swapped it) and is left out of the report; excluded attention
            gives the model its own attention back.
        attention: False is ``exclude=["neuron-flash-attn"]`` (the attention kernels).
        mlp: False is ``exclude=["neuron-mlp"]``.

    Attention is not swapped as a layer (transformers tags no attention class) but routed through
    transformers' ``AttentionInterface``: the registry's attention function is registered, with
    transformers' sdpa mask, under a name without "flash" and the model is switched to it; modules the
    kernel cannot serve run the model's own attention, and the report has a row per attention module.
    Attention classes that bypass the interface get a layer like any other (``FalconAttention``).

    Returns:
        The same model. ``model.kernels_neuron_report`` lists every module considered.

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    ...                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=32)).eval()
    >>> model = kernelize(model, device="neuron")
    >>> len(model.kernels_neuron_report.swapped)  # 3 norms, 1 MLP and 1 attention module
    5
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"kernelize: expected a torch.nn.Module, got {type(model).__name__}")
    device = _device_key(device)
    for name, value in (("attention", attention), ("mlp", mlp)):
        if not isinstance(value, bool):
            raise TypeError(f"kernelize: {name} must be True or False, got {value!r}")
    reg = registry_module.load()
    chosen = _chosen_kernels(reg, only, exclude, attention, mlp)
    requested = resolve_mode(model, mode)
    # Hooking transformers' modeling classes first tags their subclasses too (FalconFlashAttention2 inherits
    # FalconAttention's tag), so those are candidates (kept, with why, if the layer cannot serve them).
    register_mapping(devices=tuple(dict.fromkeys((device, "cpu"))), reg=reg)
    candidates = find_candidates(model, reg)
    considered = {id(module) for _, module, _ in candidates}
    for _, module, _ in candidates:  # a new report: reasons recorded at earlier calls are dropped
        vars(module).pop(FALLBACK_ATTRIBUTE, None)
    kept = [(m, layer) for _, m, layer in candidates if layer.repo not in chosen]
    candidates = [c for c in candidates if c[2].repo in chosen]
    for cls, layer in {type(m): layer for _, m, layer in candidates}.items():
        hook(cls, layer, reg)
    with _quiet_kernels_logging(), keeping_own_forward(kept):
        kernels.kernelize(model, mode=requested, device=device, use_fallback=True)
    report = KernelizeReport(device=device, mode=mode_name(requested))
    for path, module, layer in candidates:
        kernel = f"{reg.repo_id(layer.repo)}:{layer.kernel_layer}"
        if swapped_to(module, layer):
            report.rows.append(ReportRow(path, layer.name, kernel, "swapped", module=weakref.ref(module)))
            continue
        reasons = violations(layer, module, reg)
        if not supports(layer, requested) and not reasons:
            reasons = [f"mode {mode_name(requested)} is not among the layer's modes {list(layer.modes)}"]
        report.rows.append(
            ReportRow(
                path,
                layer.name,
                kernel,
                "fallback",
                "; ".join(reasons) or "the kernels library kept the original forward",
                weakref.ref(module),
            )
        )
    route_attention = any(entry.repo in chosen for entry in reg.attention)
    if route_attention:
        report.rows += kernelize_attention(model, reg, requested)
    else:
        restore_own_attention(model, reg)
    report.rows += without_kernel(model, considered, route_attention)
    if report.fallbacks:
        warnings.warn(
            f"kernels-neuron: kernelize kept {len(report.fallbacks)} module(s) on their own forward, e.g. "
            f"{report.fallbacks[0].path}: {report.fallbacks[0].reason} (model.kernels_neuron_report lists "
            "them all)",
            stacklevel=2,
        )
    setattr(model, REPORT_ATTRIBUTE, report)
    return model
