"""Integrity of a built kernel variant: its files against the sha256 digest in its ``metadata.json``.

The digest and its comparison are the kernels library's own (``Metadata``, ``Digest.hash_variant``,
``Digest.validate``: what it checks signed kernels with), not a second scheme. Used by
``kernels-neuron install`` (the build before copying, the snapshot before publishing it), by
``kernelize`` before it loads a repo, and, shipped into every variant as ``_verify.py``, by the
variant's own ``__init__`` before it imports anything else: whichever route loads a repo
(``get_kernel``, ``kernelize``, ``use_kernels=True``, ``attn_implementation=``), an edited, missing,
extra or truncated file is refused with the list of differences.

This module imports only the standard library and the kernels library, as the Hub copy must.
"""

from __future__ import annotations

from pathlib import Path


class KernelIntegrityError(ImportError):
    """A kernel variant's files differ from the digest in its metadata.json."""


def verify_variant(variant: Path | str) -> None:
    """Raise ``KernelIntegrityError`` naming every file of ``variant`` (a ``build/<variant>`` folder) that
    is edited, missing or unknown to its metadata.json's digest (``__pycache__`` is not counted)."""
    from kernels._rust import Digest, DigestValidationError, Metadata  # the kernels library's digest (verify.py)

    variant = Path(variant)
    advice = "reinstall it (`kernels-neuron install`) or rebuild it (`kernels-neuron build`)"
    try:
        metadata = Metadata.from_bytes((variant / "metadata.json").read_bytes())
    except (OSError, ValueError) as exc:
        raise KernelIntegrityError(f"kernel variant {variant}: unreadable metadata.json ({exc}); {advice}") from None
    if metadata.digest is None:
        raise KernelIntegrityError(f"kernel variant {variant}: metadata.json has no digest to verify; {advice}")
    try:
        metadata.digest.validate(Digest.hash_variant(metadata.digest.algorithm, variant))
    except DigestValidationError as exc:
        differences = "; ".join(str(v) for v in exc.violations)
        raise KernelIntegrityError(
            f"kernel variant {variant} does not match the digest in its metadata.json: {differences}; {advice}"
        ) from None


def verify_repo(repo: Path | str) -> None:
    """``verify_variant`` for every variant of a built repo folder (``<repo>/build/*``)."""
    variants = sorted(p.parent for p in Path(repo).glob("build/*/metadata.json"))
    if not variants:
        raise KernelIntegrityError(f"kernel repo {repo} has no variant with a metadata.json")
    for variant in variants:
        verify_variant(variant)
