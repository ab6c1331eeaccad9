"""The enums of ``nki.isa`` (``nisa.engine``, ``nisa.reduce_cmd`` ...): instruction arguments that name an
engine, a reduce command, a DMA mode or a NeuronCore generation.

Members carry the integer values AWS's ``nki.isa`` documents (``engine.tensor`` is 1,
``engine.unknown`` 0, ``nc_version.gen3`` 3), so ``nisa.engine(1)`` is the Tensor Engine as in NKI.
"""

from __future__ import annotations

import enum
import functools


class _NkiEnum(enum.Enum):
    """An NKI enum that also accepts its member's name, in any case (``dge_mode="hwdge"``)."""

    @classmethod
    def _missing_(cls, value: object):
        if isinstance(value, str):
            for member in cls:
                if member.name == value.lower():
                    return member
        return None


class engine(_NkiEnum):
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


tensor_engine, vector_engine, scalar_engine, gpsimd_engine, unknown_engine = (
    engine.tensor,
    engine.vector,
    engine.scalar,
    engine.gpsimd,
    engine.unknown,
)


class reduce_cmd(_NkiEnum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(_NkiEnum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(_NkiEnum):
    error = 0
    skip = 1


class matmul_perf_mode(_NkiEnum):
    none = "none"
    double_row = "double_row"


@functools.total_ordering
class nc_version(_NkiEnum):
    gen2 = 2
    gen3 = 3
    gen4 = 4

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, nc_version):
            return NotImplemented
        return self.value < other.value


class dma_engine(_NkiEnum):
    dma = 1
    gpsimd_dma = 2


class dependency(_NkiEnum):
    """How ``NkiInstruction.depends_on`` orders a pair: ``runtime`` is a hardware semaphore wait (the
    consumer starts once the producer has finished); ``schedule`` only constrains the order in which the
    compiler issues them (on different engines they may still overlap)."""

    runtime = "runtime"
    schedule = "schedule"
