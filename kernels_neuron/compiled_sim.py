"""An optional compiled build of the simulator's hot modules: the same source files, compiled by Cython.

A trace-only simulation spends its time in the simulator's own Python (per simulated instruction: the
operand views, the NeuronCore's rules, the memory bookkeeping, the trace record), about 25-33 µs of
CPU on the 2-core development machine. Cython compiles :data:`MODULES` as they are (nothing is
rewritten for it), in its pure-Python mode with no annotation used as a C type (``annotation_typing``
off), so every function keeps Python's semantics and a float stays a Python or NumPy float. The
README ("A compiled build") has the measured gain.

Use::

    pip install 'kernels-neuron[fast]'      # Cython and setuptools; a C compiler must be on PATH
    kernels-neuron compile-sim              # once per change of the modules' sources

The build goes to the user cache, in a folder named by a digest of the modules' sources and the
interpreter's ABI (:func:`build_dir`). When ``kernels_neuron`` is imported, :func:`activate` puts a
finder in front of the import system that loads the compiled modules, only from the folder of the
current digest: after an edit of any of them, the whole set falls back to the Python sources until
the next ``compile-sim``, never a stale build. ``KERNELS_NEURON_SIM_COMPILED=0`` turns it off (the
test run does: a compiled module has no doctests to collect). :func:`status` says which ran.

>>> build_dir().parent.name, len(MODULES)
('compiled-sim', 9)
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from .paths import PACKAGE_DIR

ENV_VAR = "KERNELS_NEURON_SIM_COMPILED"
# The simulator's modules on a trace-only run's hot path (views, rules, memory, records, allocation).
MODULES = (
    "kernels_neuron.sim.dtypes",
    "kernels_neuron.sim.indirection",
    "kernels_neuron.sim.isa",
    "kernels_neuron.sim.language",
    "kernels_neuron.sim.memory",
    "kernels_neuron.sim.operands",
    "kernels_neuron.sim.runtime",
    "kernels_neuron.sim.tensor",
    "kernels_neuron.sim.trace",
)
# Cython's pure-Python mode with Python's semantics: annotations stay annotations (a ``float`` argument
# is not turned into a C double), no type inference, keyword arguments and introspection as in Python.
DIRECTIVES = {
    "language_level": 3,
    "annotation_typing": False,
    "infer_types": False,
    "binding": True,
    "always_allow_keywords": True,
}
_MARKER = "complete"  # written last: a folder without it is an interrupted build
KEPT_BUILDS = 3  # builds of other sources kept beside the newest (other checkouts, other commits)
_COMPILE_ONE = """
import json, sys
from Cython.Build import cythonize
from setuptools import setup
setup(
    ext_modules=cythonize([sys.argv[1]], compiler_directives=json.loads(sys.argv[2]), quiet=True),
    script_args=["build_ext", "--inplace", "--quiet"],
)
"""


SOURCE_ROOT = PACKAGE_DIR.parent  # where ``kernels_neuron`` is: a checkout, or site-packages


def _module_file(root: Path, module: str) -> Path:
    """The source file of the dotted ``module`` in a package tree under ``root``."""
    return root.joinpath(*module.split(".")).with_suffix(".py")


def digest(modules: Sequence[str] = MODULES, root: Path | None = None) -> str:
    """A digest of the modules' names and sources (the package's, or the copies under ``root``), the
    directives, and the interpreter and platform."""
    abi = (sys.implementation.cache_tag, importlib.machinery.EXTENSION_SUFFIXES[0])
    sha = hashlib.sha256(repr((sorted(modules), DIRECTIVES, abi)).encode())
    for module in sorted(modules):
        sha.update(module.encode() + b"\0" + _module_file(root or SOURCE_ROOT, module).read_bytes() + b"\0")
    return sha.hexdigest()[:20]


def cache_root() -> Path:
    """``$KERNELS_NEURON_CACHE`` if set, else ``$XDG_CACHE_HOME/kernels-neuron`` (``~/.cache`` by default)."""
    if os.environ.get("KERNELS_NEURON_CACHE"):
        return Path(os.environ["KERNELS_NEURON_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kernels-neuron"


def _folder(source_digest: str) -> Path:
    return cache_root() / "compiled-sim" / f"{sys.implementation.cache_tag}-{source_digest}"


def build_dir(modules: Sequence[str] = MODULES) -> Path:
    """Where the build of these modules' current sources is (or would be) kept."""
    return _folder(digest(modules))


def _complete(folder: Path, modules: Sequence[str]) -> bool:
    return (folder / _MARKER).is_file() and all(_extension(folder, m).is_file() for m in modules)


def is_built(modules: Sequence[str] = MODULES) -> bool:
    """Whether a complete build of these modules' current sources is in the cache: the marker written
    last, and every module's extension (a damaged build counts as none, and compile-sim replaces it)."""
    try:
        folder = build_dir(modules)
    except OSError:  # an install without the sources: nothing to compile or to match
        return False
    return _complete(folder, modules)


def _extension(folder: Path, module: str) -> Path:
    return folder / (module.rpartition(".")[2] + importlib.machinery.EXTENSION_SUFFIXES[0])


class _CompiledFinder:
    """A meta path finder (the import system's protocol: ``find_spec``) for each of ``modules`` as its
    extension module in ``folder``."""

    def __init__(self, folder: Path, modules: Sequence[str]):
        self.folder, self.modules = folder, frozenset(modules)

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, _extension(self.folder, fullname))


def _finder() -> _CompiledFinder | None:
    return next((f for f in sys.meta_path if isinstance(f, _CompiledFinder)), None)


def switched_off() -> bool:
    """Whether ``KERNELS_NEURON_SIM_COMPILED`` turns the compiled build off in this environment."""
    return os.environ.get(ENV_VAR, "") in ("0", "false", "False", "no")


def activate(modules: Sequence[str] = MODULES) -> bool:
    """Load ``modules`` from their compiled build from now on, if there is a complete one of their current
    sources and ``KERNELS_NEURON_SIM_COMPILED`` is not 0 (when it is 1 and there is none, a warning says
    so). A module imported before keeps its Python form, so ``kernels_neuron`` calls this on import,
    before the simulator loads. Returns whether these modules load compiled."""
    finder = _finder()
    if switched_off() or finder is not None:
        return finder is not None and finder.modules == frozenset(modules)
    if not is_built(modules):
        if os.environ.get(ENV_VAR) == "1":
            warnings.warn(
                f"{ENV_VAR}=1, but there is no compiled build of the simulator's current sources: it runs "
                "them as Python (kernels-neuron compile-sim builds it)",
                stacklevel=2,
            )
        return False
    sys.meta_path.insert(0, _CompiledFinder(build_dir(modules), modules))
    return True


def loaded() -> list[str]:
    """The modules imported so far from the compiled build."""
    finder = _finder()
    if finder is None:
        return []
    return sorted(
        name
        for name in finder.modules
        if isinstance(getattr(sys.modules.get(name), "__loader__", None), importlib.machinery.ExtensionFileLoader)
    )


def status() -> str:
    """One line: which form of the simulator this process runs, and how to change it."""
    if switched_off():
        return f"pure Python ({ENV_VAR}=0)"
    finder = _finder()
    if finder is not None:
        return f"compiled ({len(finder.modules)} modules, {finder.folder})"
    return "pure Python (no compiled build of the current sources: kernels-neuron compile-sim)"


def _check_tools() -> None:
    missing = [name for name in ("Cython", "setuptools") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"compile-sim needs {' and '.join(missing)}: pip install 'kernels-neuron[fast]' (and a C compiler)"
        )


def build(
    modules: Sequence[str] = MODULES,
    jobs: int | None = None,
    on_done: Callable[[str, float], None] | None = None,
    force: bool = False,
) -> Path:
    """Compile ``modules`` into :func:`build_dir` (nothing to do if it is complete, unless ``force``: a build
    whose files are all there but do not load) and return the folder.

    Each module compiles in its own subprocess (Cython, then the C compiler through setuptools), ``jobs``
    at a time (default: the usable CPUs); ``on_done(module, seconds)`` is called as each finishes. A
    compiler's error is raised with its output. The folder appears whole or not at all."""
    import concurrent.futures
    import shutil
    import subprocess
    import tempfile
    import time

    from filelock import FileLock

    source_digest = digest(modules)
    folder = _folder(source_digest)
    if _complete(folder, modules) and not force:
        return folder
    _check_tools()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if _complete(folder, modules) and not force:  # another process built it meanwhile
            return folder
        with tempfile.TemporaryDirectory(prefix="kernels-neuron-compile-") as scratch:
            work = Path(scratch)
            for module in modules:  # the package layout, so each extension gets its dotted name
                target = _module_file(work, module)
                target.parent.mkdir(parents=True, exist_ok=True)
                for package in target.relative_to(work).parents:
                    if package != Path("."):
                        (work / package / "__init__.py").touch()
                shutil.copyfile(_module_file(SOURCE_ROOT, module), target)
            if digest(modules, root=work) != source_digest:
                raise RuntimeError("a module's source changed while compile-sim waited for another build: run it again")

            def compile_one(module: str) -> tuple[str, float]:
                start = time.perf_counter()
                source = _module_file(Path(), module).as_posix()
                result = subprocess.run(
                    [sys.executable, "-c", _COMPILE_ONE, source, json.dumps(DIRECTIVES)],
                    cwd=work,
                    capture_output=True,
                    text=True,
                )
                if result.returncode != 0:
                    raise RuntimeError(f"compiling {module} failed:\n{result.stdout}{result.stderr}")
                return module, time.perf_counter() - start

            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            workers = jobs or cpus
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                for future in concurrent.futures.as_completed([pool.submit(compile_one, m) for m in modules]):
                    module, seconds = future.result()
                    if on_done is not None:
                        on_done(module, seconds)
            partial = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
            for module in modules:
                relative = _extension(Path(*module.split(".")[:-1]), module)
                shutil.copyfile(work / relative, _extension(partial, module))
            (partial / _MARKER).write_text("\n".join(modules) + "\n")
            if folder.exists():  # a damaged build of the same sources, or one rebuilt by force
                shutil.rmtree(folder)
            partial.rename(folder)
    _prune(folder)
    return folder


def _prune(newest: Path) -> None:
    """Delete all but the KEPT_BUILDS most recent complete builds of other sources beside ``newest``
    (about 25 MB each). A process that loaded one keeps its mapped files."""
    import shutil

    others = [
        f for f in newest.parent.glob(f"{sys.implementation.cache_tag}-*") if f != newest and (f / _MARKER).is_file()
    ]
    others.sort(key=lambda f: (f / _MARKER).stat().st_mtime, reverse=True)
    for old in others[KEPT_BUILDS:]:
        shutil.rmtree(old, ignore_errors=True)
        Path(str(old) + ".lock").unlink(missing_ok=True)
