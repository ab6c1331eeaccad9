"""Every kernel in the registry has each piece CONTRIBUTING.md's "Adding a kernel" checklist names.

A kernel family is a module of ``nki_src`` named by a ``kind = "kernel"`` repo (``nki = [...]``); its
pieces are found by that name. ``missing_pieces`` is the checklist as code.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from kernels_neuron import paths, registry, sim
from kernels_neuron.bench.suite import CASES
from kernels_neuron.registry import Repo

ROOT = paths.PACKAGE_DIR.parent
# The places, as CONTRIBUTING.md spells them ({family} is the nki_src module's name).
PLACES = (
    "nki_src/{family}.py",
    "kernels_neuron/ops/{family}.py",
    "kernels_neuron/ops/{family}_layers.py",
    "registry.toml",
    "tests/ops/test_{family}.py",
    "tests/models/test_kernelize_{family}.py",
    "kernels_neuron/bench/suite.py",
    "tests/test_bench_references.py",
    "benchmarks/hub/",
)


def _text(relative: str) -> str:
    path = ROOT / relative
    return path.read_text() if path.is_file() else ""


def _jit_kernels(module) -> list:
    return [v for v in vars(module).values() if isinstance(v, sim.Kernel) and v.__module__ == module.__name__]


def families(repo: Repo) -> list[str]:
    """The kernel families ``repo`` owns: the NKI module its layers module is named after. Any other NKI
    module it ships is another family's kernels that its own import (neuron-moe's kernels share the gated
    MLP's tiling helpers), checked under that family's own repo."""
    return [family for family in repo.nki if repo.layers == f"{family}_layers"] or list(repo.nki)


def missing_pieces(repo: Repo, reg: registry.Registry) -> list[str]:
    """What the checklist asks of ``repo``'s kernel families and is not there."""
    missing = []
    references = [name for name in repo.export_names if name.endswith("_reference")]
    if not references:
        missing.append(f"{repo.name}: exports no *_reference (the pure-torch reference)")
    for family in families(repo):
        if not (ROOT / f"nki_src/{family}.py").is_file():
            missing.append(f"nki_src/{family}.py")
            continue
        kernels = _jit_kernels(importlib.import_module(f"nki_src.{family}"))
        if not kernels:
            missing.append(f"nki_src/{family}.py: no @nki.jit kernel")
        if family not in repo.ops or not (ROOT / f"kernels_neuron/ops/{family}.py").is_file():
            missing.append(f"kernels_neuron/ops/{family}.py (and in the repo's ops)")
        else:
            ops = importlib.import_module(f"kernels_neuron.ops.{family}")
            if not any(isinstance(v, torch.library.CustomOpDef) for v in vars(ops).values()):
                missing.append(f"kernels_neuron/ops/{family}.py: no torch.library custom op")
            if not any(callable(getattr(ops, name, None)) for name in references):
                missing.append(f"kernels_neuron/ops/{family}.py: none of {references} is defined there")
        if repo.layers != f"{family}_layers" or not (ROOT / f"kernels_neuron/ops/{family}_layers.py").is_file():
            missing.append(f"kernels_neuron/ops/{family}_layers.py (the repo's layers)")
        else:
            attention_repo = any(entry.repo == repo.name for entry in reg.attention)
            if attention_repo:
                # Models reach an attention function through transformers' attention interface, and
                # kernelize asks the repo's exported unsupported_reasons per module.
                functions = {entry.function for entry in reg.attention if entry.repo == repo.name}
                missing += [
                    f"{repo.name}: exports {name}"
                    for name in sorted(functions | {"unsupported_reasons"})
                    if name not in repo.export_names
                ]
            kernel_layers = {layer.kernel_layer for layer in reg.layers if layer.repo == repo.name}
            if kernel_layers or not attention_repo:  # an attention repo's layers serve modules the interface misses
                plugin = importlib.import_module(f"kernels_neuron.ops.{family}_layers")
                limits = getattr(plugin, "LIMITS", None)
                if not (
                    callable(getattr(plugin, "unsupported_reasons", None))
                    and (isinstance(limits, str) or (isinstance(limits, dict) and kernel_layers <= set(limits)))
                ):
                    missing.append(
                        f"kernels_neuron/ops/{family}_layers.py: unsupported_reasons and LIMITS (one text or one "
                        "per layer)"
                    )
                missing += [
                    f"kernels_neuron/ops/{family}_layers.py: class {layer}"
                    for layer in sorted(kernel_layers)
                    if not hasattr(plugin, layer)
                ]
        if not any(name in _text(f"tests/ops/test_{family}.py") for name in references):
            missing.append(f"tests/ops/test_{family}.py (comparing with {references})")
        if "kernelize(" not in _text(f"tests/models/test_kernelize_{family}.py"):
            missing.append(f"tests/models/test_kernelize_{family}.py (kernelize on tiny models)")
        benched = {case.kernel for case in CASES}
        missing += [f"kernels_neuron/bench/suite.py: a case for {k.__name__}" for k in kernels if k not in benched]
    if not repo.benchmarks or not all((ROOT / f"benchmarks/hub/{b}.py").is_file() for b in repo.benchmarks):
        missing.append(f"benchmarks/hub/: the repo's `kernels benchmark` scripts {list(repo.benchmarks)}")
    return missing


def test_every_kernel_repo_has_every_piece():
    reg = registry.load()
    kernel_repos = [repo for repo in reg.repos.values() if repo.kind == "kernel"]
    assert {family for repo in kernel_repos for family in families(repo)} == {
        "rmsnorm",
        "layernorm",
        "attention",
        "mlp",
        "moe",
    }
    assert {repo.name: missing_pieces(repo, reg) for repo in kernel_repos} == {repo.name: [] for repo in kernel_repos}


def test_the_checklist_finds_a_kernel_without_its_pieces():
    """Negative control: a repo naming a family with none of its pieces misses every one."""
    reg = registry.load()
    ghost = Repo(
        name="neuron-ghost",
        version=1,
        kind="kernel",
        description="",
        ops=("_backend",),
        layers="ghost_layers",
        nki=("ghost",),
    )
    assert missing_pieces(ghost, reg) == [
        "neuron-ghost: exports no *_reference (the pure-torch reference)",
        "nki_src/ghost.py",
        "benchmarks/hub/: the repo's `kernels benchmark` scripts []",
    ]
    half = Repo(
        name="neuron-half",
        version=1,
        kind="kernel",
        description="",
        ops=("_backend",),
        layers=None,
        nki=("rmsnorm",),
        exports=("rms_norm_reference",),
    )
    found = missing_pieces(half, reg)
    assert "kernels_neuron/ops/rmsnorm.py (and in the repo's ops)" in found
    assert "kernels_neuron/ops/rmsnorm_layers.py (the repo's layers)" in found


def test_contributing_lists_every_place_the_checklist_checks():
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    assert [place for place in PLACES if place not in contributing] == []
    assert all(Path(ROOT / place.format(family="rmsnorm")).exists() for place in PLACES)
