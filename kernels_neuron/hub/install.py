"""Install the built repos into the local Hugging Face cache, as the Hub would have put them.

Each repo lands in ``<cache>/kernels--<org>--<name>/snapshots/<sha>/`` with ``refs/v<version>``
naming that snapshot, so ``get_kernel("<org>/<name>", version=N)`` with ``HF_HUB_OFFLINE=1``
takes the kernels library's ordinary Hub path. ``<sha>`` is a content hash of the repo.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from .. import registry as registry_module
from ..registry import Registry
from .build import BUILD_DIR, repo_files, stale


def default_cache() -> Path:
    """Where the kernels library looks: ``KERNELS_CACHE`` if set, else huggingface_hub's ``HF_HUB_CACHE``."""
    from huggingface_hub import constants

    return Path(os.environ.get("KERNELS_CACHE") or constants.HF_HUB_CACHE)


def install(cache: Path | str | None = None, registry: Registry | None = None,
            build_dir: Path = BUILD_DIR) -> dict[str, Path]:
    """Copy every built repo into the HF cache; return ``{repo_id: snapshot path}``."""
    registry = registry or registry_module.load()
    problems = stale(build_dir, registry)
    if problems:
        raise RuntimeError(f"build/ is stale ({len(problems)} files differ, e.g. {problems[0]}); run `kernels-neuron build` first")
    cache = Path(cache) if cache is not None else default_cache()
    installed = {}
    for repo in registry.repos.values():
        source = build_dir / repo.name
        files = repo_files(source)
        content = hashlib.sha1()
        for path in files:
            content.update(path.relative_to(source).as_posix().encode() + b"\0" + path.read_bytes())
        sha = content.hexdigest()
        root = cache / f"kernels--{registry.org}--{repo.name}"
        snapshot = root / "snapshots" / sha
        if snapshot.exists():
            shutil.rmtree(snapshot)
        for path in files:
            target = snapshot / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / f"v{repo.version}").write_text(sha)
        installed[registry.repo_id(repo.name)] = snapshot
    return installed
