"""``registry.toml``: the Hub repos kernels-neuron builds and the layers ``kernelize`` swaps in."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from .paths import REGISTRY_PATH

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
    """A layer ``kernelize`` swaps in: modules whose class is in ``classes`` (or is tagged ``name`` by
    transformers) get the forward of ``kernel_layer``, a class of ``repo``'s ``layers`` module, in ``modes``.
    With ``discover``, also modules of other classes whose name ends with it and whose forward the
    layer's plug-in says it ``computes``. What a module must be beyond that, the plug-in's
    ``unsupported_reasons`` says."""

    name: str
    repo: str
    kernel_layer: str
    modes: tuple[str, ...]
    classes: tuple[str, ...] = ()
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
        return self._layers_by_class.get(cls.__name__) or (
            self._layers_by_name.get(tag) if isinstance(tag, str) else None
        )


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


# A repo's name is also its kernel's name in metadata.json, which the kernels library restricts further.
KERNEL_NAME = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")


def _check_names(org: str, repo: str) -> None:
    """Hub rules for the org and the repo name: they become paths (``build/<repo>``, the HF cache's
    ``kernels--<org>--<repo>``), so anything else (``..``, ``/``, spaces) is refused."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(org, str) or not isinstance(repo, str):
        raise ValueError(f"registry: the org and repo names must be strings, got {org!r} and {repo!r}")
    try:
        validate_repo_id(f"{org}/{repo}")
    except HFValidationError as exc:
        raise ValueError(f"registry: {org + '/' + repo!r} is not a valid Hub repo id: {exc}") from None
    if not KERNEL_NAME.fullmatch(repo):
        raise ValueError(
            f"registry: repo name {repo!r} is not a valid kernel name (lowercase letters, digits and "
            f"'-', starting with a letter: {KERNEL_NAME.pattern})"
        )


def load(path: Path | str = REGISTRY_PATH) -> Registry:
    """Parse and check ``registry.toml``; errors name the entry and the field."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"registry file not found: {path}") from exc
    hub = raw.get("hub", {})
    org = hub.get("org", "kernels-neuron")
    repos = {}
    for name, entry in raw.get("repos", {}).items():
        _check_names(org, name)
        kind = entry.get("kind", "kernel")
        if kind not in REPO_KINDS:
            raise ValueError(f"registry: repo {name!r}: kind {kind!r} is not one of {REPO_KINDS}")
        if not isinstance(entry.get("version"), int) or entry["version"] < 1:
            raise ValueError(f"registry: repo {name!r}: version must be a positive integer")
        repos[name] = Repo(
            name=name,
            version=entry["version"],
            kind=kind,
            description=entry.get("description", ""),
            ops=tuple(entry.get("ops", ())),
            layers=entry.get("layers"),
            nki=tuple(entry.get("nki", ())),
            exports=tuple(entry.get("exports", ())),
            benchmarks=tuple(entry.get("benchmarks", ())),
        )
    layers = []
    for i, entry in enumerate(raw.get("layers", ())):
        where = f"registry: layers[{i}] ({entry.get('name', '?')})"
        _check_entry(where, entry, ("name", "repo", "kernel_layer", "modes"), repos)
        _check_modes(where, entry["modes"])
        unknown = set(entry) - {"name", "repo", "kernel_layer", "modes", "classes", "discover"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        layers.append(
            Layer(
                name=entry["name"],
                repo=entry["repo"],
                kernel_layer=entry["kernel_layer"],
                modes=tuple(entry["modes"]),
                classes=tuple(entry.get("classes", ())),
                discover=entry.get("discover"),
            )
        )
    attention = []
    for i, entry in enumerate(raw.get("attention", ())):
        where = f"registry: attention[{i}] ({entry.get('name', '?')})"
        _check_entry(where, entry, ("name", "repo", "function", "modes"), repos)
        if entry["function"] not in repos[entry["repo"]].export_names:
            raise ValueError(f"{where}: function {entry['function']!r} is not among the exports of {entry['repo']!r}")
        if "flash" in entry["name"]:
            raise ValueError(
                f"{where}: the name must not contain 'flash' (transformers would treat it as a "
                "flash-attention implementation)"
            )
        _check_modes(where, entry["modes"])
        attention.append(
            Attention(name=entry["name"], repo=entry["repo"], function=entry["function"], modes=tuple(entry["modes"]))
        )
    return Registry(
        org=org, license=hub.get("license", "apache-2.0"), repos=repos, layers=tuple(layers), attention=tuple(attention)
    )
