"""What ``kernelize`` and ``register_mapping`` check before the kernels library loads a repo.

- Each repo folder the kernels library will load (a ``LOCAL_KERNELS`` entry, this checkout's
  ``build/``, or an installed snapshot in the HF cache) must match its digests (``verify_repo``).
- In a source checkout, ``build/`` must not be stale: kernels built from older sources would run
  silently otherwise, so ``kernelize`` warns, naming the files and the command that rebuilds them.

Both are repeated only when a file involved changed (size or modification time), so kernelizing many
models costs one check.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from .. import paths
from ..registry import Registry
from .verify import verify_repo

_checked: dict[object, tuple] = {}  # what was checked -> the fingerprint it was checked at


def _fingerprint(roots: list[Path]) -> tuple:
    return tuple(
        (str(p), p.stat().st_mtime_ns, p.stat().st_size)
        for root in roots
        for p in sorted(root.rglob("*") if root.is_dir() else [root])
        if p.is_file() and "__pycache__" not in p.parts
    )


def _once(key: object, roots: list[Path], check) -> None:
    fingerprint = _fingerprint(roots)
    if _checked.get(key) != fingerprint:
        check()
        _checked[key] = fingerprint


def local_kernels() -> dict[str, Path]:
    """``LOCAL_KERNELS`` ("org/name=path:...") as ``{repo_id: path}``."""
    entries = [e.split("=", 1) for e in os.environ.get("LOCAL_KERNELS", "").split(":") if "=" in e]
    return {repo_id: Path(path) for repo_id, path in entries}


def _cached_snapshot(reg: Registry, name: str) -> Path | None:
    """The HF-cache snapshot ``get_kernel(..., version=N)`` would load offline, if it is installed."""
    from .install import default_cache

    root = default_cache() / f"kernels--{reg.org}--{name}"
    ref = root / "refs" / f"v{reg.repos[name].version}"
    snapshot = root / "snapshots" / ref.read_text().strip() if ref.is_file() else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def check_before_loading(reg: Registry) -> None:
    """Verify every repo folder the kernels library would load for ``reg``; warn when this checkout's
    ``build/`` is stale."""
    local = local_kernels()
    for name in reg.repos:
        folder = local.get(reg.repo_id(name)) or _cached_snapshot(reg, name)
        if folder is not None:
            _once(("verify", folder), [folder], lambda folder=folder: verify_repo(folder))
    if paths.IS_CHECKOUT and paths.BUILD_DIR.is_dir():
        sources = [paths.PACKAGE_DIR, paths.NKI_DIR, paths.REGISTRY_PATH, paths.HUB_BENCHMARKS_DIR, paths.BUILD_DIR]
        _once("stale", sources, _warn_if_stale)


def _warn_if_stale() -> None:
    from .build import stale

    problems = stale()
    if problems:
        warnings.warn(
            f"kernels-neuron: build/ is stale ({len(problems)} files differ from the sources, e.g. "
            f"{problems[0]}): the kernels that load are not the sources' - run `kernels-neuron build`",
            stacklevel=4,
        )
