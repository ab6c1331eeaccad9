"""Torch ops backed by the NKI kernels in ``nki_src`` (simulated on CPU, real NKI on Trainium)."""

from ..sim import install as _install_nki

_install_nki()  # `import nki` must resolve before the kernel modules load
