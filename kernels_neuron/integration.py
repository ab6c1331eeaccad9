"""``kernelize(model, device="neuron")``: swap the registry's NKI layers into a transformers model.

It works through the kernels library itself (so it does not depend on transformers' kernels
gate): it hooks the model's layer classes with ``kernels.replace_kernel_forward_from_hub`` (by
class name where transformers does not decorate the class, or decorates it with a name whose
numerics differ), attaches each layer's constraints as the per-module condition, registers the
registry's mapping, calls ``kernels.kernelize`` and reports, per candidate module, whether it
was swapped or kept its own forward and why.

The kernels are loaded from this checkout's ``build/`` through ``LOCAL_KERNELS`` when it exists
(offline), else from the Hub. Hooking a class and registering a mapping are process-wide, as
everything in the kernels library is. ``register_mapping`` also hooks the registry's classes in
transformers' modeling modules (those already imported, and each one as it is imported), so
transformers' own ``use_kernels=True`` route gets the same layer per class and the same
constraints as ``kernelize``.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.abc
import inspect
import io
import logging
import os
import re
import sys
import textwrap
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import kernels
from kernels import LayerRepository, Mode
from rich.console import Console
from rich.table import Table
from torch import nn

from . import registry as registry_module
from .hub.build import BUILD_DIR
from .hub.loading import check_before_loading
from .ops._backend import FALLBACK_ATTRIBUTE, record_fallback
from .registry import Layer, Registry

_MODE_NAMES = {"inference": Mode.INFERENCE, "training": Mode.TRAINING, "torch.compile": Mode.TORCH_COMPILE}


@dataclass(frozen=True)
class ReportRow:
    """One candidate module: where it is, which registry layer matched, and what happened at kernelize;
    ``call_time_fallback`` is why a swapped module last ran its own forward since (None if it never did)."""

    path: str
    layer: str
    kernel: str
    status: str  # "swapped" | "fallback" | "no kernel"
    reason: str = ""
    module: Any = field(default=None, repr=False, compare=False)  # a weakref.ref to the module

    @property
    def call_time_fallback(self) -> str | None:
        module = self.module() if self.module is not None else None
        return getattr(module, FALLBACK_ATTRIBUTE, None) if self.status == "swapped" else None


@dataclass
class KernelizeReport:
    """What ``kernelize`` did to each candidate module. Prints as a table."""

    device: str
    mode: str
    rows: list[ReportRow] = field(default_factory=list)

    @property
    def swapped(self) -> list[ReportRow]:
        return [r for r in self.rows if r.status == "swapped"]

    @property
    def fallbacks(self) -> list[ReportRow]:
        return [r for r in self.rows if r.status == "fallback"]

    @property
    def no_kernel(self) -> list[ReportRow]:
        """Modules of kinds the hub has no kernel for (LayerNorm, MoE experts, other MLPs, unrouted attention)."""
        return [r for r in self.rows if r.status == "no kernel"]

    @property
    def call_time_fallbacks(self) -> list[ReportRow]:
        """Swapped modules that have since run their own forward for a call the kernel could not serve."""
        return [r for r in self.rows if r.call_time_fallback is not None]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def table(self) -> Table:
        since = len(self.call_time_fallbacks)
        table = Table(title=f"kernels-neuron kernelize report (device={self.device}, mode={self.mode}): "
                            f"{len(self.swapped)} swapped, {len(self.fallbacks)} kept their own forward"
                            + (f", {len(self.no_kernel)} with no kernel" if self.no_kernel else "")
                            + (f", {since} fell back at call time" if since else "")
                            + ("" if self.rows else "; no module of a kind the hub has kernels for"))
        for column in ("module", "layer", "kernel", "status"):
            table.add_column(column, overflow="fold")
        for row in self.rows:
            status = {"swapped": "[green]swapped[/]", "fallback": f"[yellow]fallback[/]: {row.reason}",
                      "no kernel": f"[dim]no kernel[/]: {row.reason}"}[row.status]
            if row.call_time_fallback is not None:
                status += f"; [yellow]fell back at call time[/]: {row.call_time_fallback}"
            table.add_row(row.path, row.layer, row.kernel, status)
        return table

    def __str__(self) -> str:
        console = Console(width=160, file=io.StringIO())
        console.print(self.table())
        return console.file.getvalue()


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
            if key not in _MODE_NAMES:
                raise ValueError(f"kernelize: unknown mode {part!r}; use {sorted(_MODE_NAMES)} joined by '+'")
            keys.append(key)
        if ("inference" in keys) == ("training" in keys):
            raise ValueError(f"kernelize: mode {mode!r} must name exactly one of 'inference' and 'training' "
                             "(optionally with '+torch.compile')")
        resolved = _MODE_NAMES[keys[0]]
        for key in keys[1:]:
            resolved |= _MODE_NAMES[key]
        return resolved
    raise TypeError(f"kernelize: mode must be None, a kernels.Mode or a string, got {type(mode).__name__}")


def _mode_name(mode: Mode) -> str:
    return "+".join(name for name, flag in _MODE_NAMES.items() if flag in mode)


def _registered_modes(layer: Layer) -> list[Mode]:
    bases = [_MODE_NAMES[m] for m in ("inference", "training") if m in layer.modes]
    compiled = [base | Mode.TORCH_COMPILE for base in bases] if "torch.compile" in layer.modes else []
    return bases + compiled


# The registered modes that serve a requested mode, as the kernels library looks them up.
_SERVED_BY = {
    Mode.INFERENCE: (Mode.INFERENCE, Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING, Mode.TRAINING | Mode.TORCH_COMPILE),
    Mode.TRAINING: (Mode.TRAINING, Mode.TRAINING | Mode.TORCH_COMPILE),
    Mode.INFERENCE | Mode.TORCH_COMPILE: (Mode.INFERENCE | Mode.TORCH_COMPILE, Mode.TRAINING | Mode.TORCH_COMPILE),
    Mode.TRAINING | Mode.TORCH_COMPILE: (Mode.TRAINING | Mode.TORCH_COMPILE,),
}


def supports(layer: Layer, mode: Mode) -> bool:
    return any(m in _SERVED_BY.get(mode, ()) for m in _registered_modes(layer))


def violations(layer: Layer, module: nn.Module, reg: Registry) -> list[str]:
    """Why ``module`` cannot take ``layer``'s kernel (empty when it can): the registry's structure
    constraint, a forward something else already replaced, and the layer's own checks (the same
    ``unsupported_reasons`` its forward asks on every call)."""
    if "structure" in layer.constraints:
        problems = _structure_problems(layer, module)
        if problems:
            return problems
    replaced = vars(module).get("forward")
    if replaced is not None and not _swapped_to(module, layer):
        name = getattr(replaced, "__qualname__", type(replaced).__name__)
        return [f"{type(module).__name__}'s forward was replaced by {name} (e.g. a tensor-parallel plan or an "
                "accelerate hook), which swapping it would drop"]
    return _layers_module(reg, layer).unsupported_reasons(layer.layer, module)


def _layers_module(reg: Registry, layer: Layer) -> types.ModuleType:
    """The layer's module in kernels_neuron.ops: the same source as the Hub repo's ``layers``."""
    return importlib.import_module(f"{__package__}.ops.{reg.repos[layer.repo].layers}")


def layer_limits(reg: Registry, layer: Layer) -> str:
    """What a module must be for ``layer``'s kernel to serve it, in words (``kernels-neuron list``, cards)."""
    structure = layer.constraints.get("structure")
    prefix = f"forward with the {structure} structure; " if structure else ""
    return prefix + _layers_module(reg, layer).LIMITS


# --- gated MLPs -----------------------------------------------------------------------------------------
# A gated MLP is swapped only when its class's forward, read from its source, computes exactly
# down(act(gate(x)) * up(x)): many classes named *MLP hold gate/up/down projections but add clamps,
# multipliers, norms or dropout (FalconH1, DeepseekV4, BitNet, ...), and would silently come out wrong.

_MLP_STRUCTURES = {"gated_mlp": ("gate_proj", "up_proj"), "gated_mlp_fused": ("gate_up_proj",)}


def _symbolic(node: ast.AST, env: dict) -> Any:
    """A hashable description of what an expression of a forward computes, or None if not understood."""
    if isinstance(node, ast.Name):
        return env.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = _symbolic(node.left, env), _symbolic(node.right, env)
        return None if left is None or right is None else ("mul", frozenset((left, right)))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self" and len(node.args) == 1 and not node.keywords):
        arg = _symbolic(node.args[0], env)
        return None if arg is None else ("call", node.func.attr, arg)
    return None


def _chunk_halves(node: ast.AST, env: dict) -> Any:
    """``e.chunk(2, dim=-1)`` or ``e.chunk(2, -1)``: the symbolic ``e``, else None."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "chunk"):
        return None
    try:
        args = [ast.literal_eval(a) for a in node.args]
        dims = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    except ValueError:
        return None
    if args[:1] != [2] or [*args[1:], *dims.values()] != [-1] or set(dims) - {"dim"}:
        return None
    return _symbolic(node.func.value, env)


@functools.lru_cache(maxsize=None)
def gated_mlp_form(cls: type) -> tuple[str, str] | None:
    """(structure, activation attribute) when ``cls.forward(self, x)`` returns exactly
    ``down_proj(act(gate_proj(x)) * up_proj(x))`` ("gated_mlp") or Phi3's ``gate, up =
    gate_up_proj(x).chunk(2, dim=-1)`` then ``down_proj(up * act(gate))`` ("gated_mlp_fused"),
    with ``act`` the module's ``act_fn`` or ``activation_fn``; None otherwise."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if tree.body else None
    if not isinstance(function, ast.FunctionDef):
        return None
    args = function.args
    if ([a.arg for a in args.args][:1] != ["self"] or len(args.args) != 2 or args.vararg or args.kwarg
            or args.kwonlyargs or args.posonlyargs or args.defaults):
        return None
    env: dict = {args.args[1].arg: ("x",)}
    result = None
    for statement in function.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # docstring
        if isinstance(statement, ast.Return) and statement.value is not None and result is None:
            result = _symbolic(statement.value, env)
            continue
        if not isinstance(statement, ast.Assign) or len(statement.targets) != 1 or result is not None:
            return None
        target = statement.targets[0]
        if isinstance(target, ast.Name):
            env[target.id] = _symbolic(statement.value, env)
        elif (isinstance(target, ast.Tuple) and len(target.elts) == 2
              and all(isinstance(e, ast.Name) for e in target.elts)):
            whole = _chunk_halves(statement.value, env)
            env[target.elts[0].id] = None if whole is None else ("half", 0, whole)
            env[target.elts[1].id] = None if whole is None else ("half", 1, whole)
        else:
            return None
    x = ("x",)
    for act in ("act_fn", "activation_fn"):
        separate = ("mul", frozenset((("call", act, ("call", "gate_proj", x)), ("call", "up_proj", x))))
        gate_up = ("call", "gate_up_proj", x)
        fused = ("mul", frozenset((("call", act, ("half", 0, gate_up)), ("half", 1, gate_up))))
        if result == ("call", "down_proj", separate):
            return "gated_mlp", act
        if result == ("call", "down_proj", fused):
            return "gated_mlp_fused", act
    return None


def _structure_problems(layer: Layer, module: nn.Module) -> list[str]:
    form = gated_mlp_form(type(module))
    wanted = layer.constraints["structure"]
    if form is None or form[0] != wanted:
        projections = " * ".join(f"{p}(x)" for p in _MLP_STRUCTURES.get(wanted, ()))
        return [f"{type(module).__name__}.forward is not the gated MLP the kernel computes "
                f"(down_proj(act({projections})))"]
    present = [a for a in ("act_fn", "activation_fn") if hasattr(module, a)]
    if present and present[0] != form[1]:
        return [f"{type(module).__name__}.forward uses {form[1]} but the layer would read {present[0]}"]
    return []


def _ensure_local_kernels(reg: Registry) -> bool:
    """Point the kernels library at this checkout's build/ (keeping entries the user set)."""
    if not all((BUILD_DIR / name).is_dir() for name in reg.repos):
        return False
    entries = [e for e in os.environ.get("LOCAL_KERNELS", "").split(":") if e]
    present = {e.split("=", 1)[0] for e in entries}
    entries += [f"{reg.repo_id(name)}={BUILD_DIR / name}" for name in reg.repos if reg.repo_id(name) not in present]
    os.environ["LOCAL_KERNELS"] = ":".join(entries)
    return True


def _pinned_version(reg: Registry, repo: str) -> dict[str, str | int]:
    """How to ask the kernels library for the registry's version of ``repo``: a local build/ checkout
    is addressed by its version branch name, a Hub repo by its version."""
    version = reg.repos[repo].version
    return {"revision": f"v{version}"} if _ensure_local_kernels(reg) else {"version": version}


def register_mapping(devices: tuple[str, ...] = ("neuron", "cpu"), reg: Registry | None = None) -> None:
    """Register the registry's layers with the kernels library for ``devices``.

    After this, transformers' own route (``use_kernels=True``, which kernelizes for the model's
    device) also picks up the NKI layers: the registry's classes in transformers' modeling
    modules are hooked (by class name, with the layer's constraints) now if already imported,
    else when their module is imported.
    """
    reg = reg or registry_module.load()
    _ensure_local_kernels(reg)
    check_before_loading(reg)
    mapping = {}
    for layer in reg.layers:
        repository = LayerRepository(reg.repo_id(layer.repo), layer_name=layer.layer,
                                     **_pinned_version(reg, layer.repo))
        modes = {mode: repository for mode in _registered_modes(layer)}
        mapping[layer.name] = {device: modes for device in devices}
    kernels.register_kernel_mapping(mapping, inherit_mapping=True)
    _hook_transformers_classes(reg)


def _discovered_layer(cls: type, reg: Registry) -> Layer | None:
    """A layer with ``discover`` whose structure ``cls`` has (its name ends with the suffix and its
    forward is the layer's computation): e.g. any other SwiGLU/GeGLU MLP class."""
    form = None
    for layer in reg.layers:
        if layer.discover and cls.__name__.endswith(layer.discover):
            form = form or gated_mlp_form(cls)
            if form is not None and form[0] == layer.constraints.get("structure"):
                return layer
    return None


def _candidates(model: nn.Module, reg: Registry) -> list[tuple[str, nn.Module, Layer]]:
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
                _hook(cls, layer, reg)


class _HookingLoader(importlib.abc.Loader):
    """Runs a module's own loader, then hooks the registry's classes in it."""

    def __init__(self, loader: Any, finder: "_TransformersHook") -> None:
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


def _hook(cls: type, layer: Layer, reg: Registry) -> None:
    kernels.replace_kernel_forward_from_hub(cls, layer.name,
                                            condition=lambda module: not violations(layer, module, reg))


def _swapped_to(module: nn.Module, layer: Layer) -> bool:
    """True when ``module`` runs ``layer``'s forward from our kernel package (whose module names
    start with the builder's id ``_<repo>_<backend>_<hash>``), not its own or another kernel's."""
    function = getattr(module.forward, "__func__", None)
    package = f"_{layer.repo.replace('-', '_')}_"
    return (isinstance(function, types.FunctionType) and function is not type(module).forward
            and function.__qualname__ == f"{layer.layer}.forward" and function.__module__.startswith(package))


MLP_REPO = "neuron-mlp"  # kernelize(mlp=False) leaves this repo's layers out


@contextlib.contextmanager
def _keeping_own_forward(kept: list[tuple[nn.Module, Layer]]):
    """While kernels.kernelize runs, the ``kept`` modules fail their class's condition (so they are
    skipped), and any that an earlier call swapped get their own forward back."""
    ids = {id(module) for module, _ in kept}
    saved = {}
    for cls in {type(module) for module, _ in kept}:
        condition = getattr(cls, "kernel_condition", None) or (lambda m: True)
        saved[cls] = cls.__dict__.get("kernel_condition")
        cls.kernel_condition = staticmethod(lambda m, c=condition: id(m) not in ids and c(m))
    for module, layer in kept:
        if _swapped_to(module, layer):
            del module.forward  # the instance attribute the kernels library set; the class's forward shows again
    try:
        yield
    finally:
        for cls, original in saved.items():
            if original is None:
                del cls.kernel_condition
            else:
                cls.kernel_condition = original


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


def kernelize(model: nn.Module, device: str = "neuron", mode: Any = None, attention: bool = True,
              mlp: bool = True) -> nn.Module:
    """Swap kernels-neuron's NKI layers into ``model`` and attach ``model.kernels_neuron_report``.

    Args:
        model: a transformers (or any) model whose layer classes the registry names.
        device: the kernels-library device key the mapping is registered for ("neuron"); the
            variant that loads is the system's (``torch-cpu`` without Trainium).
        mode: None (from ``model.training``), a ``kernels.Mode``, or "inference", "training",
            "inference+torch.compile", "training+torch.compile".
        attention: route the model's attention through the registry's attention function (False leaves
            attention alone and swaps only layers).
        mlp: swap the gated MLPs (False leaves every MLP with its own forward, even one an earlier
            call swapped, and out of the report).

    Attention is not swapped as a layer (transformers tags no attention class) but routed through
    transformers' ``AttentionInterface``: the registry's attention function is registered, with
    transformers' sdpa mask, under a name without "flash" and the model is switched to it; modules the
    kernel cannot serve run the model's own attention, and the report has a row per attention module.

    Returns:
        The same model. ``model.kernels_neuron_report`` lists every candidate module.

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
    requested = resolve_mode(model, mode)
    candidates = _candidates(model, reg)
    considered = {id(module) for _, module, _ in candidates}
    for _, module, _ in candidates:  # a new report: reasons recorded at earlier calls are dropped
        vars(module).pop(FALLBACK_ATTRIBUTE, None)
    kept = [(m, layer) for _, m, layer in candidates if not mlp and layer.repo == MLP_REPO]
    candidates = [c for c in candidates if mlp or c[2].repo != MLP_REPO]
    for cls, layer in {type(m): layer for _, m, layer in candidates}.items():
        _hook(cls, layer, reg)
    register_mapping(devices=tuple(dict.fromkeys((device, "cpu"))), reg=reg)
    with _quiet_kernels_logging(), _keeping_own_forward(kept):
        kernels.kernelize(model, mode=requested, device=device, use_fallback=True)
    report = KernelizeReport(device=device, mode=_mode_name(requested))
    for path, module, layer in candidates:
        kernel = f"{reg.repo_id(layer.repo)}:{layer.layer}"
        if _swapped_to(module, layer):
            report.rows.append(ReportRow(path, layer.name, kernel, "swapped", module=weakref.ref(module)))
            continue
        reasons = violations(layer, module, reg)
        if not supports(layer, requested) and not reasons:
            reasons = [f"mode {_mode_name(requested)} is not among the layer's modes {list(layer.modes)}"]
        report.rows.append(ReportRow(path, layer.name, kernel, "fallback",
                                     "; ".join(reasons) or "the kernels library kept the original forward",
                                     weakref.ref(module)))
    if attention:
        report.rows += _kernelize_attention(model, reg, requested)
    else:
        _restore_own_attention(model, reg)
    report.rows += _without_kernel(model, considered, attention)
    if report.fallbacks:
        warnings.warn(f"kernels-neuron: kernelize kept {len(report.fallbacks)} module(s) on their own forward, e.g. "
                      f"{report.fallbacks[0].path}: {report.fallbacks[0].reason} (model.kernels_neuron_report lists "
                      "them all)", stacklevel=2)
    model.kernels_neuron_report = report
    return model


DEVICES = ("neuron", "cpu")  # the kernels-library device keys kernelize registers the hub's layers for


def _device_key(device: Any) -> str:
    """``device`` ("neuron", "cpu", "neuron:0", a torch.device) as the kernels-library key, or a clear error."""
    key = device.type if type(device).__name__ == "device" else device
    key = key.split(":", 1)[0] if isinstance(key, str) else key
    if key not in DEVICES:
        raise ValueError(f"kernelize: device {device!r} is not one kernels-neuron serves; use 'neuron' (Trainium, "
                         "or its kernels on the CPU simulator where there is none) or 'cpu' (the simulator)")
    return key

# Kinds of module the hub has no kernel for yet, by class name, so that the report can say so
# rather than leave them out: (what the name ends with, the kind, why).
_UNSERVED_KINDS = (
    ("LayerNorm", "LayerNorm", "no LayerNorm kernel in the hub yet"),
    ("Experts", "MoE experts", "no MoE-experts kernel in the hub yet"),
    ("MLP", "MLP", "not a gated MLP down(act(gate(x)) * up(x)), the only MLP the hub has a kernel for"),
)


def _without_kernel(model: nn.Module, candidates: set[int], attention: bool) -> list[ReportRow]:
    """Report rows for the modules of kinds the hub has no kernel for (or a form it does not take), and
    for attention modules kernelize cannot route."""
    rows = []
    routed = {id(m) for _, m in _attention_modules(model)} if attention else set()
    for path, module in model.named_modules():
        if id(module) in candidates or id(module) in routed:
            continue
        name = type(module).__name__
        kind = next(((k, why) for suffix, k, why in _UNSERVED_KINDS if name.endswith(suffix)), None)
        if kind is None and isinstance(module, nn.LayerNorm):
            kind = ("LayerNorm", _UNSERVED_KINDS[0][2])
        if kind is None and attention and name.endswith("Attention"):
            kind = ("attention", "not routed: its model does not call transformers' AttentionInterface for it")
        if kind is not None:
            rows.append(ReportRow(path or "<model>", kind[0], "-", "no kernel", f"{name}: {kind[1]}",
                                  weakref.ref(module)))
    return rows


# --- attention ------------------------------------------------------------------------------------------
# transformers tags no attention class, so attention is not swapped as a layer: each attention module
# calls ALL_ATTENTION_FUNCTIONS[config._attn_implementation]. kernelize registers a dispatcher there
# (and transformers' sdpa mask in ALL_MASK_ATTENTION_FUNCTIONS under the same name; without it padded
# batches would silently get no mask) and switches the model to that name. The dispatcher asks the
# kernel package, per call, whether it can serve the module (unsupported_reasons) and otherwise runs
# the model's own attention (sdpa, or eager where sdpa cannot: softcap, sinks, an eager model).

ATTENTION_LAYER = "attention"
_ORIGINAL_ATTENTION = "_kernels_neuron_original_attention"  # set on each attention module by kernelize


def _load_attention_kernel(reg: Registry, name: str) -> Any:
    entry = next(e for e in reg.attention if e.name == name)
    return kernels.get_kernel(reg.repo_id(entry.repo), **_pinned_version(reg, entry.repo))


def _bool_mask_as_additive(mask: Any, dtype: Any) -> Any:
    import torch

    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                       torch.full((), torch.finfo(dtype).min, dtype=dtype, device=mask.device))


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
    def kernels_neuron_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                 is_causal=None, **kwargs):
        reasons = kernel.unsupported_reasons(module, module.training, query, key, value, dropout, kwargs.get("s_aux"))
        if reasons:
            record_fallback(module, "; ".join(reasons))
            return _own_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)
        return kernel.flash_attn_forward(module, query, key, value, attention_mask, dropout=dropout,
                                         scaling=scaling, is_causal=is_causal, **kwargs)

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

    _ensure_local_kernels(reg)
    check_before_loading(reg)
    loaded = {}
    for entry in reg.attention:
        loaded[entry.name] = _load_attention_kernel(reg, entry.name)
        AttentionInterface.register(entry.name, _attention_dispatcher(loaded[entry.name]))
        AttentionMaskInterface.register(entry.name, sdpa_mask)
    return loaded


def _restore_own_attention(model: nn.Module, reg: Registry) -> None:
    """``attention=False`` on a model an earlier kernelize routed: back to the attention it had before."""
    names = {entry.name for entry in reg.attention}
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) in names:
        originals = {getattr(m, _ORIGINAL_ATTENTION, "sdpa") for _, m in _attention_modules(model)}
        model.set_attn_implementation(originals.pop() if len(originals) == 1 else "sdpa")


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers attention modules that call the function AttentionInterface holds for their config."""
    found = []
    for path, module in model.named_modules():
        modeling = sys.modules.get(type(module).__module__)
        if (type(module).__name__.endswith("Attention") and hasattr(module, "config")
                and modeling is not None and hasattr(modeling, "ALL_ATTENTION_FUNCTIONS")):
            found.append((path or "<model>", module))
    return found


def _kernelize_attention(model: nn.Module, reg: Registry, requested: Mode) -> list[ReportRow]:
    modules = _attention_modules(model)
    if not reg.attention or not modules:
        return []
    entry = reg.attention[0]
    kernel_label = f"{reg.repo_id(entry.repo)}:{entry.function}"
    training = Mode.TRAINING in requested

    def rows(reason: str | None, kernel: Any = None) -> list[ReportRow]:
        out = []
        for path, module in modules:
            reasons = [reason] if reason else kernel.unsupported_reasons(module, training=training)
            out.append(ReportRow(path, ATTENTION_LAYER, kernel_label, "fallback" if reasons else "swapped",
                                 "; ".join(reasons), weakref.ref(module)))
        return out

    wanted = [name for name, flag in _MODE_NAMES.items() if flag in requested]
    missing = [name for name in wanted if name not in entry.modes]
    if missing:
        return rows(f"mode {_mode_name(requested)} is not among the attention function's modes {list(entry.modes)}")
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return rows(f"{type(model).__name__} does not let transformers set its attention implementation")
    kernel = _register_attention(reg)[entry.name]
    original = model.config._attn_implementation
    for _, module in modules:
        vars(module).pop(FALLBACK_ATTRIBUTE, None)
        if not hasattr(module, _ORIGINAL_ATTENTION):  # kernelizing twice keeps the model's own
            setattr(module, _ORIGINAL_ATTENTION, original if original in ("sdpa", "eager") else "sdpa")
    model.set_attn_implementation(entry.name)
    return rows(None, kernel)
