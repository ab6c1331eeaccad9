"""Opt-in conformance runs: AWS's own NKI kernels, unmodified, on the simulator.

The kernels are read from local checkouts of AWS's repositories, named by environment variables;
without them every conformance test skips and says which variable to set. Nothing of AWS's code is
copied into this project.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

NKI_LIBRARY_ENV_VAR = "NKI_LIBRARY_DIR"
AWS_NEURON_SDK_ENV_VAR = "AWS_NEURON_SDK_DIR"


def checkout_from_env(variable: str, marker_path: str) -> Path:
    """The checkout named by ``variable``; skips the test when it is unset or lacks ``marker_path``."""
    value = os.environ.get(variable, "")
    if not value:
        pytest.skip(f"conformance run needs a checkout: set {variable} (see README, 'Conformance with AWS's kernels')")
    root = Path(value)
    if not (root / marker_path).exists():
        pytest.fail(f"{variable}={value} is not a checkout: {marker_path} is missing")
    return root


@pytest.fixture(scope="session")
def nki_library_src() -> Iterator[Path]:
    """nki-library's ``src/nkilib_src`` on ``sys.path``, so ``import nkilib`` resolves to the checkout."""
    source = checkout_from_env(NKI_LIBRARY_ENV_VAR, "src/nkilib_src/nkilib") / "src" / "nkilib_src"
    sys.path.insert(0, str(source))
    yield source
    sys.path.remove(str(source))


@pytest.fixture(scope="session")
def sdk_examples_dir() -> Path:
    """aws-neuron-sdk's ``nki/examples`` directory."""
    return checkout_from_env(AWS_NEURON_SDK_ENV_VAR, "nki/examples") / "nki" / "examples"


@pytest.fixture
def load_example(sdk_examples_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """Import one example file by its path under ``nki/examples``.

    Some examples set ``NEURON_PLATFORM_TARGET_OVERRIDE`` when imported (the tutorials target
    trn1); the variable is restored after the test so other tests keep their target.
    """

    def load(relative_path: str) -> ModuleType:
        monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE", raising=False)
        path = sdk_examples_dir / relative_path
        name = "aws_nki_example_" + relative_path.replace("/", "_").replace("-", "_").removesuffix(".py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect conformance tests unless the ``-m`` expression names them.

    Doing it here rather than with ``-m "not conformance"`` in addopts keeps them out of runs that
    pass their own ``-m`` (``-m "not slow"`` replaces addopts' expression).
    """
    if "conformance" in (config.option.markexpr or ""):
        return
    deselected = [item for item in items if item.get_closest_marker("conformance")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("conformance")]
