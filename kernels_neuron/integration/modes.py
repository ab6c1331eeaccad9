"""kernelize's modes: "inference" or "training", optionally "+torch.compile", as the kernels library's ``Mode``."""

from __future__ import annotations

from typing import Any

from kernels import Mode
from torch import nn

from ..registry import Layer

MODE_NAMES = {"inference": Mode.INFERENCE, "training": Mode.TRAINING, "torch.compile": Mode.TORCH_COMPILE}


def resolve_mode(model: nn.Module, mode: Any) -> Mode:
    """``None`` follows ``model.training``; strings like "inference" or "training+torch.compile" work."""
    if mode is None:
        return Mode.TRAINING if model.training else Mode.INFERENCE
    if isinstance(mode, Mode):
        return mode
    if isinstance(mode, str):
        keys = []
        for part in mode.replace("|", "+").split("+"):
            key = part.strip().lower()
            if key not in MODE_NAMES:
                raise ValueError(f"kernelize: unknown mode {part!r}; use {sorted(MODE_NAMES)} joined by '+'")
            keys.append(key)
        if ("inference" in keys) == ("training" in keys):
            raise ValueError(
                f"kernelize: mode {mode!r} must name exactly one of 'inference' and 'training' "
                "(optionally with '+torch.compile')"
            )
        resolved = MODE_NAMES[keys[0]]
        for key in keys[1:]:
            resolved |= MODE_NAMES[key]
        return resolved
    raise TypeError(f"kernelize: mode must be None, a kernels.Mode or a string, got {type(mode).__name__}")


def mode_name(mode: Mode) -> str:
    """ "inference", "training+torch.compile" ...: a Mode as kernelize spells it."""
    return "+".join(name for name, flag in MODE_NAMES.items() if flag in mode)


def registered_modes(layer: Layer) -> list[Mode]:
    """The Modes a registry layer is registered for with the kernels library."""
    bases = [MODE_NAMES[m] for m in ("inference", "training") if m in layer.modes]
    compiled = [base | Mode.TORCH_COMPILE for base in bases] if "torch.compile" in layer.modes else []
    return bases + compiled


# The registered modes that serve a requested mode, as the kernels library looks them up.
_SERVED_BY = {
    Mode.INFERENCE: (
        Mode.INFERENCE,
        Mode.INFERENCE | Mode.TORCH_COMPILE,
        Mode.TRAINING,
        Mode.TRAINING | Mode.TORCH_COMPILE,
    ),
    Mode.TRAINING: (Mode.TRAINING, Mode.TRAINING | Mode.TORCH_COMPILE),
    Mode.INFERENCE | Mode.TORCH_COMPILE: (Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE),
    Mode.TRAINING | Mode.TORCH_COMPILE: (Mode.TRAINING | Mode.TORCH_COMPILE,),
}


def supports(layer: Layer, mode: Mode) -> bool:
    """Whether the kernels library would serve a requested ``mode`` with one of ``layer``'s registered modes."""
    return any(m in _SERVED_BY.get(mode, ()) for m in registered_modes(layer))
