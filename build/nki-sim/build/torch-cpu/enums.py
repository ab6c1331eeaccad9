"""The enums of ``nki.isa`` (``nisa.engine``, ``nisa.reduce_cmd`` ...): instruction arguments that name an
engine, a reduce command, a DMA mode or a NeuronCore generation."""

from __future__ import annotations

import enum
import functools


class _NkiEnum(enum.Enum):
    """An NKI enum that also accepts its member's name (any case) or declaration index."""

    @classmethod
    def _missing_(cls, value: object):
        members = list(cls)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(members):
            return members[value]
        if isinstance(value, str):
            for member in members:
                if member.name == value.lower():
                    return member
        return None


class engine(_NkiEnum):
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    dma = "dma"
    sync = "sync"
    unknown = "unknown"


tensor_engine, vector_engine, scalar_engine, gpsimd_engine, unknown_engine = (
    engine.tensor,
    engine.vector,
    engine.scalar,
    engine.gpsimd,
    engine.unknown,
)


class reduce_cmd(_NkiEnum):
    idle = "idle"
    reset = "reset"
    reduce = "reduce"
    reset_reduce = "reset_reduce"
    load_reduce = "load_reduce"


class dge_mode(_NkiEnum):
    unknown = "unknown"
    swdge = "swdge"
    hwdge = "hwdge"
    none = "none"


class oob_mode(_NkiEnum):
    error = "error"
    skip = "skip"


class matmul_perf_mode(_NkiEnum):
    none = "none"
    double_row = "double_row"


@functools.total_ordering
class nc_version(_NkiEnum):
    gen2 = "gen2"
    gen3 = "gen3"
    gen4 = "gen4"

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, nc_version):
            return NotImplemented
        return int(self.value[3:]) < int(other.value[3:])


class dma_engine(_NkiEnum):
    dma = "dma"
    gpsimd_dma = "gpsimd_dma"
