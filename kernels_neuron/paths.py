"""Where kernels-neuron's files are: in a source checkout, or inside an installed wheel.

A checkout keeps the registry (``registry.toml``), the built Hub repos (``build/``), the Hub repos'
``kernels benchmark`` scripts (``benchmarks/hub/``) and the examples (``examples/``) at its root,
beside the packages. A wheel carries the same four inside the package, in ``kernels_neuron/_data/``
(``force-include`` in pyproject.toml), so an installed kernels-neuron finds them without a checkout
(``kernels-neuron build --check`` compares ``build/`` with its sources there too). The NKI kernels
(``nki_src``) are a package of their own in both.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
_CHECKOUT_ROOT = PACKAGE_DIR.parent
IS_CHECKOUT = (_CHECKOUT_ROOT / "registry.toml").is_file()
DATA_DIR = _CHECKOUT_ROOT if IS_CHECKOUT else PACKAGE_DIR / "_data"

REGISTRY_PATH = DATA_DIR / "registry.toml"
BUILD_DIR = DATA_DIR / "build"
HUB_BENCHMARKS_DIR = DATA_DIR / "benchmarks" / "hub"
EXAMPLES_DIR = DATA_DIR / "examples"
SIM_DIR = PACKAGE_DIR / "sim"
OPS_DIR = PACKAGE_DIR / "ops"
NKI_DIR = PACKAGE_DIR.parent / "nki_src"
