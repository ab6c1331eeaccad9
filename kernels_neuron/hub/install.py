"""Install the built repos into the local Hugging Face cache, as the Hub would have put them.

Each repo lands in ``<cache>/kernels--<org>--<name>/snapshots/<sha>/`` with ``refs/v<version>``
naming that snapshot, so ``get_kernel("<org>/<name>", version=N)`` with ``HF_HUB_OFFLINE=1``
takes the kernels library's ordinary Hub path. ``<sha>`` is a content hash of the repo.

Installing is safe to repeat and to run concurrently, and a reader never sees half of it:

- idempotent: a snapshot whose content already hashes to ``<sha>`` is left as it is, and so is a
  ref that already names it;
- atomic: a snapshot is copied into a temporary folder beside the others, verified (content hash
  and every variant's digest), then renamed into place; the ref is written last, through a
  temporary file renamed over it, so it only ever names complete snapshots;
- concurrent: installs of one repo take turns under a file lock in the cache's ``.locks`` folder
  (where huggingface_hub keeps its own).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from .. import registry as registry_module
from ..registry import Registry
from .build import BUILD_DIR, repo_files, stale
from .verify import KernelIntegrityError, verify_repo


def default_cache() -> Path:
    """Where the kernels library looks: ``KERNELS_CACHE`` if set, else huggingface_hub's ``HF_HUB_CACHE``."""
    from huggingface_hub import constants

    return Path(os.environ.get("KERNELS_CACHE") or constants.HF_HUB_CACHE)


def content_hash(root: Path) -> str:
    """The snapshot name of a built repo: sha1 over its files' relative paths and contents."""
    content = hashlib.sha1()
    for path in repo_files(root):
        content.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return content.hexdigest()


def install(
    cache: Path | str | None = None, registry: Registry | None = None, build_dir: Path = BUILD_DIR
) -> dict[str, Path]:
    """Copy every built repo into the HF cache; return ``{repo_id: snapshot path}``."""
    registry = registry or registry_module.load()
    problems = stale(build_dir, registry)
    if problems:
        raise RuntimeError(
            f"build/ is stale ({len(problems)} files differ, e.g. {problems[0]}); run `kernels-neuron build` first"
        )
    cache = Path(cache) if cache is not None else default_cache()
    installed = {}
    for repo in registry.repos.values():
        source = build_dir / repo.name
        verify_repo(source)
        folder = f"kernels--{registry.org}--{repo.name}"
        (cache / ".locks" / folder).mkdir(parents=True, exist_ok=True)
        with FileLock(cache / ".locks" / folder / "kernels-neuron-install.lock"):
            installed[registry.repo_id(repo.name)] = _install_repo(source, cache / folder, repo.version)
    return installed


def _install_repo(source: Path, root: Path, version: int) -> Path:
    sha = content_hash(source)
    snapshot = root / "snapshots" / sha
    if not (snapshot.is_dir() and content_hash(snapshot) == sha):
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{sha}.", dir=snapshot.parent))
        try:
            for path in repo_files(source):
                target = staging / path.relative_to(source)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
            if content_hash(staging) != sha:
                raise KernelIntegrityError(f"install: the copy of {source} in {staging} differs from its source")
            verify_repo(staging)
            if snapshot.exists():  # a damaged snapshot of the same name: set aside, then dropped
                damaged = Path(tempfile.mkdtemp(prefix=f".{sha}.damaged.", dir=snapshot.parent))
                snapshot.rename(damaged / "snapshot")
                shutil.rmtree(damaged)
            staging.rename(snapshot)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    ref = root / "refs" / f"v{version}"
    if not (ref.is_file() and ref.read_text() == sha):
        ref.parent.mkdir(parents=True, exist_ok=True)
        fd, written = tempfile.mkstemp(prefix=f".{ref.name}.", dir=ref.parent)
        with os.fdopen(fd, "w") as handle:
            handle.write(sha)
        os.replace(written, ref)
    return snapshot
