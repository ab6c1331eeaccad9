"""Layers: the registry's classes hooked with the kernels library, the candidates in a model, and why a
module cannot take its layer's kernel.

A class is hooked with ``kernels.replace_kernel_forward_from_hub`` under its layer's name, with the
layer plug-in's ``unsupported_reasons`` as the per-module condition, so a module the kernel cannot
serve keeps its own forward. ``register_mapping`` also hooks the registry's classes in transformers'
modeling modules (those already imported, and each one as it is imported), so transformers' own
``use_kernels=True`` route gets the same layer per class and the same checks as ``kernelize``.
Hooking a class and registering a mapping are process-wide, as everything in the kernels library is.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import re
import sys
import types
from typing import Any

import kernels
from kernels import LayerRepository
from torch import nn

from .. import registry as registry_module
from ..hub.loading import check_before_loading
from ..registry import Layer, Registry
from .modes import registered_modes
from .repos import ensure_local_kernels, layers_module, pinned_version

# The class attribute the kernels library asks before swapping a module (a static predicate on it).
KERNEL_CONDITION = "kernel_condition"


def violations(layer: Layer, module: nn.Module, reg: Registry) -> list[str]:
    """Why ``module`` cannot take ``layer``'s kernel (empty when it can): a forward something else already
    replaced, else the layer plug-in's own ``unsupported_reasons`` (which its forward asks on every call)."""
    replaced = vars(module).get("forward")
    if replaced is not None and not swapped_to(module, layer):
        name = getattr(replaced, "__qualname__", type(replaced).__name__)
        return [
            f"{type(module).__name__}'s forward was replaced by {name} (e.g. a tensor-parallel plan or an "
            "accelerate hook), which swapping it would drop"
        ]
    return layers_module(reg, layer).unsupported_reasons(layer.kernel_layer, module)


def register_mapping(devices: tuple[str, ...] = ("neuron", "cpu"), reg: Registry | None = None) -> None:
    """Register the registry's layers with the kernels library for ``devices``.

    After this, transformers' own route (``use_kernels=True``, which kernelizes for the model's
    device) also picks up the NKI layers: the registry's classes in transformers' modeling
    modules are hooked (by class name, with the layers' checks) now if already imported,
    else when their module is imported.
    """
    reg = reg or registry_module.load()
    ensure_local_kernels(reg)
    check_before_loading(reg)
    mapping = {}
    for layer in reg.layers:
        repository = LayerRepository(
            reg.repo_id(layer.repo), layer_name=layer.kernel_layer, **pinned_version(reg, layer.repo)
        )
        modes = {mode: repository for mode in registered_modes(layer)}
        mapping[layer.name] = {device: modes for device in devices}
    kernels.register_kernel_mapping(mapping, inherit_mapping=True)
    _hook_transformers_classes(reg)


def _discovered_layer(cls: type, reg: Registry) -> Layer | None:
    """A layer with ``discover`` whose computation ``cls`` has (its name ends with the suffix and the
    layer plug-in's ``computes`` says its forward is the layer's): e.g. any other SwiGLU/GeGLU MLP class."""
    for layer in reg.layers:
        if (
            layer.discover
            and cls.__name__.endswith(layer.discover)
            and layers_module(reg, layer).computes(layer.kernel_layer, cls)
        ):
            return layer
    return None


def candidates(model: nn.Module, reg: Registry) -> list[tuple[str, nn.Module, Layer]]:
    """(path, module, layer) for every module of a class the registry maps (by name, tag or discovery)."""
    found = []
    for path, module in model.named_modules():
        layer = reg.layer_for(type(module)) or _discovered_layer(type(module), reg)
        if layer is not None:
            found.append((path or "<model>", module, layer))
    return found


_TRANSFORMERS_MODELING = re.compile(r"^transformers\.models\.[^.]+\.modeling_[^.]+$")


def _hook_module_classes(module: types.ModuleType, reg: Registry) -> None:
    """Hook the registry's classes defined in ``module`` (by name, or tagged with a registry layer name)."""
    for cls in list(vars(module).values()):
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == module.__name__:
            layer = reg.layer_for(cls)
            if layer is not None:
                hook(cls, layer, reg)


class _HookingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then hooks the registry's classes in it."""

    def __init__(self, loader: Any, finder: _TransformersHook) -> None:
        self._loader, self._finder = loader, finder

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _hook_module_classes(module, self._finder.registry)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package ...
        return getattr(self._loader, name)


class _TransformersHook(importlib.abc.MetaPathFinder):
    """Hooks the registry's classes in each transformers modeling module as it is imported."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def find_spec(self, fullname, path, target=None):
        if not _TRANSFORMERS_MODELING.match(fullname):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookingLoader(spec.loader, self)
                return spec
        return None


def _hook_transformers_classes(reg: Registry) -> None:
    hook = next((f for f in sys.meta_path if isinstance(f, _TransformersHook)), None)
    if hook is None:
        sys.meta_path.insert(0, _TransformersHook(reg))
    else:
        hook.registry = reg
    for name, module in list(sys.modules.items()):
        if module is not None and _TRANSFORMERS_MODELING.match(name):
            _hook_module_classes(module, reg)


def hook(cls: type, layer: Layer, reg: Registry) -> None:
    """Hook ``cls`` with the kernels library under ``layer``'s name, its modules checked one by one."""
    kernels.replace_kernel_forward_from_hub(
        cls, layer.name, condition=lambda module: not violations(layer, module, reg)
    )


def swapped_to(module: nn.Module, layer: Layer) -> bool:
    """True when ``module`` runs ``layer``'s forward from our kernel package (whose module names
    start with the builder's id ``_<repo>_<backend>_<hash>``), not its own or another kernel's."""
    function = getattr(module.forward, "__func__", None)
    package = f"_{layer.repo.replace('-', '_')}_"
    return (
        isinstance(function, types.FunctionType)
        and function is not type(module).forward
        and function.__qualname__ == f"{layer.kernel_layer}.forward"
        and function.__module__.startswith(package)
    )


@contextlib.contextmanager
def keeping_own_forward(kept: list[tuple[nn.Module, Layer]]):
    """While kernels.kernelize runs, the ``kept`` modules fail their class's condition (so they are
    skipped), and any that an earlier call swapped get their own forward back."""
    ids = {id(module) for module, _ in kept}
    saved = {}
    for cls in {type(module) for module, _ in kept}:
        condition = getattr(cls, KERNEL_CONDITION, None) or (lambda m: True)
        saved[cls] = cls.__dict__.get(KERNEL_CONDITION)
        setattr(cls, KERNEL_CONDITION, staticmethod(lambda m, c=condition: id(m) not in ids and c(m)))
    for module, layer in kept:
        if swapped_to(module, layer):
            del module.forward  # the instance attribute the kernels library set; the class's forward shows again
    try:
        yield
    finally:
        for cls, original in saved.items():
            if original is None:
                delattr(cls, KERNEL_CONDITION)
            else:
                setattr(cls, KERNEL_CONDITION, original)
