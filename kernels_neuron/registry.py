"""``registry.toml``: the Hub repos kernels-neuron builds and the layers ``kernelize`` swaps in."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REGISTRY_PATH = ROOT / "registry.toml"
MODES = ("inference", "training", "torch.compile")
REPO_KINDS = ("kernel", "simulator")


@dataclass(frozen=True)
class Repo:
    name: str
    version: int
    kind: str
    description: str
    ops: tuple[str, ...] = ()
    layers: str | None = None
    nki: tuple[str, ...] = ()
    exports: tuple[str, ...] = ()  # "name" (from the first public ops module) or "module:name"
    benchmarks: tuple[str, ...] = ()

    @property
    def export_names(self) -> tuple[str, ...]:
        """The names the package exports (``exports`` without their ``module:`` prefixes)."""
        return tuple(export.rpartition(":")[2] for export in self.exports)


@dataclass(frozen=True)
class Layer:
    name: str
    repo: str
    layer: str
    modes: tuple[str, ...]
    classes: tuple[str, ...] = ()
    constraints: dict[str, Any] = field(default_factory=dict)
    # Also match modules of other classes whose name ends with this suffix and whose forward
    # has the layer's ``structure`` constraint (kernelize checks it on the source).
    discover: str | None = None


@dataclass(frozen=True)
class Attention:
    """An attention function ``kernelize`` registers with transformers' AttentionInterface (and the sdpa
    mask with AttentionMaskInterface) under ``name``, taken from ``repo``'s export ``function``."""

    name: str
    repo: str
    function: str
    modes: tuple[str, ...]


@dataclass(frozen=True)
class Registry:
    org: str
    license: str
    repos: dict[str, Repo]
    layers: tuple[Layer, ...]
    attention: tuple[Attention, ...] = ()

    def repo_id(self, repo: str) -> str:
        return f"{self.org}/{repo}"

    @cached_property
    def _layers_by_class(self) -> dict[str, Layer]:
        return {name: layer for layer in self.layers for name in layer.classes}

    @cached_property
    def _layers_by_name(self) -> dict[str, Layer]:
        return {layer.name: layer for layer in self.layers}

    def layer_for(self, cls: type) -> Layer | None:
        """The layer for a module class: by class name, else by the layer name it is tagged with
        (transformers' ``kernel_layer_name``)."""
        tag = getattr(cls, "kernel_layer_name", None)
        return self._layers_by_class.get(cls.__name__) or self._layers_by_name.get(tag)


def _check_entry(where: str, entry: dict[str, Any], required: tuple[str, ...], repos: dict[str, Repo]) -> None:
    for key in required:
        if key not in entry:
            raise ValueError(f"{where}: missing {key!r}")
    if entry["repo"] not in repos:
        raise ValueError(f"{where}: repo {entry['repo']!r} is not defined under [repos]")


def _check_modes(where: str, modes: list[str]) -> None:
    bad = set(modes) - set(MODES)
    if bad:
        raise ValueError(f"{where}: unknown modes {sorted(bad)}; use {MODES}")


def load(path: Path | str = REGISTRY_PATH) -> Registry:
    """Parse and check ``registry.toml``; errors name the entry and the field."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"registry file not found: {path}") from exc
    hub = raw.get("hub", {})
    repos = {}
    for name, entry in raw.get("repos", {}).items():
        kind = entry.get("kind", "kernel")
        if kind not in REPO_KINDS:
            raise ValueError(f"registry: repo {name!r}: kind {kind!r} is not one of {REPO_KINDS}")
        if not isinstance(entry.get("version"), int) or entry["version"] < 1:
            raise ValueError(f"registry: repo {name!r}: version must be a positive integer")
        repos[name] = Repo(name=name, version=entry["version"], kind=kind, description=entry.get("description", ""),
                           ops=tuple(entry.get("ops", ())), layers=entry.get("layers"), nki=tuple(entry.get("nki", ())),
                           exports=tuple(entry.get("exports", ())), benchmarks=tuple(entry.get("benchmarks", ())))
    layers = []
    for i, entry in enumerate(raw.get("layers", ())):
        where = f"registry: layers[{i}] ({entry.get('name', '?')})"
        _check_entry(where, entry, ("name", "repo", "layer", "modes"), repos)
        _check_modes(where, entry["modes"])
        if "discover" in entry and "structure" not in entry.get("constraints", {}):
            raise ValueError(f"{where}: 'discover' needs a 'structure' constraint to recognise modules by")
        layers.append(Layer(name=entry["name"], repo=entry["repo"], layer=entry["layer"], modes=tuple(entry["modes"]),
                            classes=tuple(entry.get("classes", ())), constraints=dict(entry.get("constraints", {})),
                            discover=entry.get("discover")))
    attention = []
    for i, entry in enumerate(raw.get("attention", ())):
        where = f"registry: attention[{i}] ({entry.get('name', '?')})"
        _check_entry(where, entry, ("name", "repo", "function", "modes"), repos)
        if entry["function"] not in repos[entry["repo"]].export_names:
            raise ValueError(f"{where}: function {entry['function']!r} is not among the exports of {entry['repo']!r}")
        if "flash" in entry["name"]:
            raise ValueError(f"{where}: the name must not contain 'flash' (transformers would treat it as a "
                             "flash-attention implementation)")
        _check_modes(where, entry["modes"])
        attention.append(Attention(name=entry["name"], repo=entry["repo"], function=entry["function"],
                                   modes=tuple(entry["modes"])))
    return Registry(org=hub.get("org", "kernels-neuron"), license=hub.get("license", "apache-2.0"), repos=repos,
                    layers=tuple(layers), attention=tuple(attention))
