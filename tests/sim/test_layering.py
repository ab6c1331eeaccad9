"""The simulator's modules import only from their own layer or below (docs/architecture.md)."""

import ast
from pathlib import Path

from kernels_neuron import sim

# Top to bottom, as docs/architecture.md lists them.
LAYERS = [
    {"__init__", "__main__", "facade", "examples"},
    {"jit", "language", "isa", "nki_typing", "gpsimd", "prng", "mx", "cores", "collectives"},
    {"operands", "indirection", "enums"},
    {"tensor", "ops"},
    {"runtime", "memory", "trace", "targets"},
    {"errors", "dtypes", "frontend", "gc_pause"},
]
SIM_DIR = Path(sim.__file__).parent


def _layer(module: str) -> int:
    (index,) = [i for i, layer in enumerate(LAYERS) if module in layer]
    return index


def _runtime_nodes(node: ast.AST):
    """``node`` and everything under it, except ``if TYPE_CHECKING:`` blocks (annotations only)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
            yield from (n for statement in child.orelse for n in _runtime_nodes(statement))
        else:
            yield from _runtime_nodes(child)


def _sim_imports(source: str) -> set[str]:
    """The simulator modules ``source`` imports when it runs, at module level or inside functions
    (``from . import name`` of something that is not a module imports the package, ``__init__``)."""
    found = set()
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module.split(".")[0]] if node.module else [alias.name for alias in node.names]
            found |= {name if (SIM_DIR / f"{name}.py").is_file() else "__init__" for name in names}
    return found


def test_every_module_has_a_layer():
    assert {p.stem for p in SIM_DIR.glob("*.py")} == set().union(*LAYERS)


def test_imports_go_down_the_layers_only():
    upward = [
        (path.stem, imported)
        for path in SIM_DIR.glob("*.py")
        for imported in _sim_imports(path.read_text())
        if _layer(imported) < _layer(path.stem)
    ]
    assert not upward


def test_the_check_finds_an_upward_import_inside_a_function():
    """Negative control: the lazy import the layering replaced (tensor.py reaching nki.language)."""
    lazy = "def __add__(self, other):\n    from . import language\n    return language.add(self, other)\n"
    imported = _sim_imports(lazy)
    assert imported == {"language"} and _layer("language") < _layer("tensor")
