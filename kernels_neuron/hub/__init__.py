"""Hub packaging: the builder of ``build/`` and the offline installer into the HF cache."""

from .build import BUILD_DIR, build_tree, stale, write
from .install import install

__all__ = ["BUILD_DIR", "build_tree", "stale", "write", "install"]
