"""Dependency-aware list scheduling of a trace onto one NeuronCore's engines.

Each engine runs its instructions in program order. An instruction starts when its engine is
free and every earlier instruction it depends on has finished: read-after-write, and, because
memory is reused, write-after-read and write-after-write on overlapping regions. DMA transfers
go round-robin onto 16 queues that run concurrently; their bytes share the core's HBM bandwidth,
which later-issued transfers may use in gaps left by earlier ones.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..sim.trace import Instruction, Region
from .hardware import Hardware
from .timing import dma_transfer_ns, engine_ns


@dataclass(slots=True)
class Slot:
    """When one instruction ran, and which earlier instruction decided its start."""

    start: float
    end: float
    engine: str
    waited_on: int | None  # index (within the program) of the instruction it waited for, if any


@dataclass
class Schedule:
    slots: list[Slot] = field(default_factory=list)
    engine_busy_ns: dict[str, float] = field(default_factory=dict)

    @property
    def makespan_ns(self) -> float:
        return max((s.end for s in self.slots), default=0.0)

    def critical_path(self) -> list[int]:
        """Indices of the chain of instructions that ends last, first to last."""
        if not self.slots:
            return []
        i: int | None = max(range(len(self.slots)), key=lambda k: self.slots[k].end)
        path = []
        while i is not None:
            path.append(i)
            i = self.slots[i].waited_on
        return path[::-1]


class _Memory:
    """Who last wrote and read each region, pruned as newer writes cover older entries."""

    def __init__(self) -> None:
        self.writes: dict[int, list[tuple[Region, float, int, str]]] = {}
        self.reads: dict[int, dict[Region, tuple[float, int, str]]] = {}

    def read_ready(self, region: Region) -> tuple[float, int | None, str | None]:
        best: tuple[float, int | None, str | None] = (0.0, None, None)
        for other, finish, idx, engine in self.writes.get(region.buffer_id, ()):
            if finish > best[0] and region.overlaps(other):
                best = (finish, idx, engine)
        return best

    def write_ready(self, region: Region) -> tuple[float, int | None, str | None]:
        best = self.read_ready(region)
        for other, (finish, idx, engine) in self.reads.get(region.buffer_id, {}).items():
            if finish > best[0] and region.overlaps(other):
                best = (finish, idx, engine)
        return best

    def wrote(self, region: Region, finish: float, idx: int, engine: str) -> None:
        kept = [e for e in self.writes.get(region.buffer_id, ()) if not _inside(e[0], region)]
        kept.append((region, finish, idx, engine))
        self.writes[region.buffer_id] = kept
        reads = self.reads.get(region.buffer_id)
        if reads:
            for other in [r for r in reads if _inside(r, region)]:
                del reads[other]

    def read(self, region: Region, finish: float, idx: int, engine: str) -> None:
        reads = self.reads.setdefault(region.buffer_id, {})
        previous = reads.get(region)
        if previous is None or previous[0] < finish:
            reads[region] = (finish, idx, engine)


def _inside(inner: Region, outer: Region) -> bool:
    return outer.p0 <= inner.p0 and inner.p1 <= outer.p1 and outer.b0 <= inner.b0 and inner.b1 <= outer.b1


class _Bandwidth:
    """Busy intervals of the HBM bandwidth, sorted and merged, each remembering who ends it."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.owners: list[int] = []

    def reserve(self, earliest: float, duration: float, owner: int) -> tuple[float, int | None]:
        """Book ``duration`` in the first gap at or after ``earliest``.

        Returns when the booking ends and which instruction's transfer it had to wait behind.
        """
        i = bisect.bisect_right(self.ends, earliest)
        t, blocker = earliest, None
        while i < len(self.starts) and self.starts[i] < t + duration:
            if self.ends[i] > t:
                t, blocker = self.ends[i], self.owners[i]
            i += 1
        end = t + duration
        self.starts.insert(i, t)
        self.ends.insert(i, end)
        self.owners.insert(i, owner)
        if i + 1 < len(self.starts) and self.starts[i + 1] <= end:
            if self.ends[i + 1] > end:
                self.ends[i], self.owners[i] = self.ends[i + 1], self.owners[i + 1]
            del self.starts[i + 1], self.ends[i + 1], self.owners[i + 1]
        if i > 0 and self.ends[i - 1] >= t:
            if self.ends[i] > self.ends[i - 1]:
                self.ends[i - 1], self.owners[i - 1] = self.ends[i], self.owners[i]
            del self.starts[i], self.ends[i], self.owners[i]
        return end, blocker


def schedule(instructions: list[Instruction], hw: Hardware) -> Schedule:
    """Place one program's instructions in time."""
    memory = _Memory()
    bandwidth = _Bandwidth()
    engine_free: dict[str, tuple[float, int | None]] = {}
    queues = [(0.0, None)] * hw.dma_queues
    next_queue = 0
    out = Schedule()
    busy = out.engine_busy_ns
    for i, inst in enumerate(instructions):
        ready, waited_on = 0.0, None
        for region in inst.reads:
            finish, idx, engine = memory.read_ready(region)
            finish += hw.cross_engine_sync_ns if engine not in (None, inst.engine) else 0.0
            if finish > ready:
                ready, waited_on = finish, idx
        for region in inst.writes:
            finish, idx, engine = memory.write_ready(region)
            finish += hw.cross_engine_sync_ns if engine not in (None, inst.engine) else 0.0
            if finish > ready:
                ready, waited_on = finish, idx
        if inst.engine == "dma":
            queue_free, queue_last = queues[next_queue]
            start = ready
            if queue_free > start:
                start, waited_on = queue_free, queue_last
            transfer = dma_transfer_ns(inst, hw)
            end, blocker = bandwidth.reserve(start + hw.dma_latency_ns, transfer, i)
            if blocker is not None:
                waited_on = blocker
            queues[next_queue] = (end, i)
            next_queue = (next_queue + 1) % hw.dma_queues
            busy["dma"] = busy.get("dma", 0.0) + transfer
        else:
            free, last = engine_free.get(inst.engine, (0.0, None))
            start = ready
            if free > start:
                start, waited_on = free, last
            duration = engine_ns(inst, hw)
            end = start + duration
            engine_free[inst.engine] = (end, i)
            busy[inst.engine] = busy.get(inst.engine, 0.0) + duration
        out.slots.append(Slot(start, end, inst.engine, waited_on))
        for region in inst.reads:
            memory.read(region, end, i, inst.engine)
        for region in inst.writes:
            memory.wrote(region, end, i, inst.engine)
    return out
