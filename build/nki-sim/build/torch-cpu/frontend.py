"""The one link from the simulator's lower layers back up to ``nki.language``.

Tensor operators (``a + b``, ``t[...] = v``, ``psum += ...``) and calling an operator object
(``nl.exp(x)``) are ``nki.language`` functions, but ``language`` is built on ``tensor`` and ``ops``,
which therefore cannot import it. ``language`` registers itself here as it loads (the simulator
package imports it before any kernel runs), and the lower layers reach it through ``language()``.
"""

from __future__ import annotations

from types import ModuleType

_language: ModuleType | None = None


def register(module: ModuleType) -> None:
    """Called once, by ``language`` at the end of its import."""
    global _language
    _language = module


def language() -> ModuleType:
    if _language is None:
        raise RuntimeError("nki.language is not loaded: import kernels_neuron.sim first")
    return _language
