"""The instruction trace a simulated run leaves behind, for the cost model and for people.

Records hold no reference to tensors: only shapes, dtypes, buffers and the memory regions each
instruction read and wrote, so that a trace never keeps kernel memory alive and dependencies
can be scheduled from it alone.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Region(NamedTuple):
    """A box of memory: buffer id, partitions [p0, p1), bytes within a partition [b0, b1).

    HBM has no partitions; an HBM region is one partition wide and its bytes are the whole
    tensor's byte range.
    """

    buffer_id: int
    p0: int
    p1: int
    b0: int
    b1: int

    def overlaps(self, other: Region) -> bool:
        return (
            self.buffer_id == other.buffer_id
            and self.p0 < other.p1
            and other.p0 < self.p1
            and self.b0 < other.b1
            and other.b0 < self.b1
        )


class Operand(NamedTuple):
    role: str  # the ISA argument name: "dst", "stationary", "data1", ...
    shape: tuple[int, ...]
    dtype: str
    buffer: str  # "sbuf" | "psum" | "hbm" | "shared_hbm" | "private_hbm"


@dataclass(slots=True)
class Instruction:
    """One executed ISA instruction.

    ``partitions`` and ``free_elements`` describe the widest operand as the engines see it;
    ``bytes_moved`` counts what DMA transferred (0 for compute engines); ``attrs`` keeps the
    facts a cost formula needs (e.g. matmul ``moving_free``, ``fp32`` inputs).
    """

    index: int
    engine: str  # "tensor" | "vector" | "scalar" | "gpsimd" | "dma" | "sync"
    op: str  # e.g. "nc_matmul", "dma_copy"
    operands: tuple[Operand, ...]
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    partitions: int
    free_elements: int
    bytes_moved: int = 0
    hbm_bytes_read: int = 0
    hbm_bytes_written: int = 0
    flops: int = 0
    program: tuple[int, ...] = ()
    rank: int = 0  # the launch's rank (sim.run_ranks); 0 in a one-rank launch
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trace:
    """Everything a run recorded: instructions in program order and peak on-chip memory."""

    target: str
    kernel: str = ""  # the launched kernel function's name
    instructions: list[Instruction] = field(default_factory=list)
    sbuf_peak_bytes: int = 0  # per partition
    psum_peak_bytes: int = 0  # per partition

    def __len__(self) -> int:
        return len(self.instructions)

    def __iter__(self):
        return iter(self.instructions)

    @property
    def hbm_bytes(self) -> int:
        return sum(i.hbm_bytes_read + i.hbm_bytes_written for i in self.instructions)

    @property
    def hbm_bytes_written(self) -> int:
        return sum(i.hbm_bytes_written for i in self.instructions)

    @property
    def flops(self) -> int:
        return sum(i.flops for i in self.instructions)

    def counts(self) -> Counter[tuple[str, str]]:
        """How many instructions ran, per (engine, op)."""
        return Counter((i.engine, i.op) for i in self.instructions)

    def summary(self) -> str:
        """A short human-readable digest: instruction mix, traffic and peak memory."""
        lines = [f"trace on {self.target}: {len(self.instructions)} instructions"]
        for (engine, op), count in sorted(self.counts().items()):
            lines.append(f"  {engine:<7} {op:<24} x{count}")
        lines.append(
            f"  HBM traffic {self.hbm_bytes:,} B, TensorE {self.flops:,} FLOP, "
            f"peak SBUF {self.sbuf_peak_bytes:,} B/partition, peak PSUM {self.psum_peak_bytes:,} B/partition"
        )
        return "\n".join(lines)
