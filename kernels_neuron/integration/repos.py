"""Where the kernels library loads the hub's repos from, and each kernel's plug-in module.

With the built repos at hand (a checkout's ``build/``, or the copy an installed wheel carries), they
are loaded offline through ``LOCAL_KERNELS``, addressed by their version branch; otherwise from the
Hub by version. Each layer's module in ``kernels_neuron.ops`` (the same source as the Hub repo's
``layers``) is its plug-in: it answers ``unsupported_reasons``, ``LIMITS`` and, for layers that
discover classes, ``computes``.
"""

from __future__ import annotations

import importlib
import os
import types

from ..paths import BUILD_DIR
from ..registry import Layer, Registry


def ensure_local_kernels(reg: Registry) -> bool:
    """Point the kernels library at the shipped build/ (keeping ``LOCAL_KERNELS`` entries the user set);
    False when there is no build/ to point at."""
    if not all((BUILD_DIR / name).is_dir() for name in reg.repos):
        return False
    entries = [e for e in os.environ.get("LOCAL_KERNELS", "").split(":") if e]
    present = {e.split("=", 1)[0] for e in entries}
    entries += [f"{reg.repo_id(name)}={BUILD_DIR / name}" for name in reg.repos if reg.repo_id(name) not in present]
    os.environ["LOCAL_KERNELS"] = ":".join(entries)
    return True


def pinned_version(reg: Registry, repo: str) -> dict[str, str | int]:
    """How to ask the kernels library for the registry's version of ``repo``: a local build/ is addressed
    by its version branch name, a Hub repo by its version."""
    version = reg.repos[repo].version
    return {"revision": f"v{version}"} if ensure_local_kernels(reg) else {"version": version}


def layers_module(reg: Registry, layer: Layer) -> types.ModuleType:
    """The layer's plug-in: its module in kernels_neuron.ops, the same source as the Hub repo's ``layers``."""
    return importlib.import_module(f"{__package__.rpartition('.')[0]}.ops.{reg.repos[layer.repo].layers}")


def layer_limits(reg: Registry, layer: Layer) -> str:
    """What a module must be for ``layer``'s kernel to serve it, in words (``kernels-neuron list``, cards):
    the plug-in's ``LIMITS``, one text for all its layers or a text per kernel layer."""
    limits = layers_module(reg, layer).LIMITS
    return limits if isinstance(limits, str) else limits[layer.kernel_layer]
