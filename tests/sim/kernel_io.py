"""What the simulator's tests share: moving test arrays into SBUF and results out to HBM inside a
kernel, and running a body of NKI calls on SBUF tiles as a kernel."""

from __future__ import annotations

from kernels_neuron import sim

sim.install()

import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402


def to_sbuf(x):
    """An HBM kernel argument copied into an SBUF tile of its shape."""
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    return tile


def to_hbm(tile):
    """A tile copied into a kernel output (``nl.shared_hbm``); a PSUM tile is evicted through SBUF
    first, as DMA cannot read PSUM."""
    if tile.buffer == nl.psum:
        staged = nl.ndarray(tile.shape, tile.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=staged, src=tile)
        tile = staged
    out = nl.ndarray(tile.shape, tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def run_body(body, *arrays, target="trn2", seed=0):
    """Load ``arrays`` into SBUF, call ``body(*tiles)``, store what it returns; the ``SimResult``."""

    @nki.jit
    def kernel(*hbm):
        outs = body(*[to_sbuf(x) for x in hbm])
        single = not isinstance(outs, (tuple, list))
        stored = tuple(to_hbm(o) for o in ((outs,) if single else outs))
        return stored[0] if single else stored

    return sim.run(kernel, *arrays, target=target, seed=seed)
