"""Dependency-aware list scheduling of a trace onto one NeuronCore's engines.

Each engine runs its instructions in program order. An instruction starts when its engine is
free and every earlier instruction it depends on has finished: read-after-write, and, because
memory is reused, write-after-read and write-after-write on overlapping regions, and the edges a
kernel added with ``NkiInstruction.depends_on`` (a ``schedule`` edge only keeps the consumer from
starting before its producer starts). DMA transfers
go round-robin onto 16 queues that each run in order and all run concurrently; their bytes
share the core's HBM bandwidth.

Dependencies are found in one pass in program order; placement is event-driven: among the
instructions at the head of their engine's (or queue's) order whose dependencies are placed,
the one that can start first goes next. So bandwidth goes to the transfer that is ready first,
not to whichever the program happened to issue first.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable
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
    """Who last wrote and read each region (program order), pruned as newer writes cover older entries."""

    def __init__(self) -> None:
        self.writes: dict[int, list[tuple[Region, int]]] = {}
        self.reads: dict[int, dict[Region, int]] = {}

    def depends(self, inst: Instruction) -> set[int]:
        """Earlier instructions ``inst`` must wait for."""
        deps: set[int] = set()
        for region in inst.reads:
            _add_overlapping(deps, region, self.writes.get(region.buffer_id, ()))
        for region in inst.writes:
            _add_overlapping(deps, region, self.writes.get(region.buffer_id, ()))
            _add_overlapping(deps, region, self.reads.get(region.buffer_id, {}).items())
        return deps

    def record(self, inst: Instruction, idx: int) -> None:
        for region in inst.reads:
            self.reads.setdefault(region.buffer_id, {})[region] = idx
        for region in inst.writes:
            kept = [e for e in self.writes.get(region.buffer_id, ()) if not _inside(e[0], region)]
            kept.append((region, idx))
            self.writes[region.buffer_id] = kept
            reads = self.reads.get(region.buffer_id)
            if reads:
                for other in [r for r in reads if _inside(r, region)]:
                    del reads[other]


def _add_overlapping(deps: set[int], region: Region, entries: Iterable[tuple[Region, int]]) -> None:
    """Add the index of every entry whose region overlaps ``region`` (``Region.overlaps`` spelt out:
    this loop is most of the scheduler's time)."""
    _, p0, p1, b0, b1 = region
    for (_, q0, q1, c0, c1), idx in entries:
        if p0 < q1 and q0 < p1 and b0 < c1 and c0 < b1:
            deps.add(idx)


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
    count = len(instructions)
    memory = _Memory()
    deps: list[set[int]] = []
    local_index = {inst.index: i for i, inst in enumerate(instructions)}
    issue_after: list[set[int]] = []  # NkiInstruction.depends_on(kind=schedule): start no earlier than these
    for i, inst in enumerate(instructions):
        # Memory dependencies, plus the edges a kernel added with NkiInstruction.depends_on.
        explicit = {local_index[j] for j in inst.attrs.get("depends_on", ()) if j in local_index}
        deps.append(memory.depends(inst) | explicit)
        issue_after.append({local_index[j] for j in inst.attrs.get("issued_after", ()) if j in local_index} - deps[i])
        memory.record(inst, i)
    dependents: list[list[int]] = [[] for _ in range(count)]
    for i in range(count):
        for j in deps[i] | issue_after[i]:
            dependents[j].append(i)
    waiting = [len(d) + len(a) for d, a in zip(deps, issue_after)]

    # Each engine, and each DMA queue, is an in-order lane.
    lanes: dict[str, list[int]] = {}
    dma_count = 0
    for i, inst in enumerate(instructions):
        lane = f"dma{dma_count % hw.dma_queues}" if inst.engine == "dma" else inst.engine
        dma_count += inst.engine == "dma"
        lanes.setdefault(lane, []).append(i)
    lane_of = {i: lane for lane, members in lanes.items() for i in members}
    position = {lane: 0 for lane in lanes}
    lane_free: dict[str, tuple[float, int | None]] = {lane: (0.0, None) for lane in lanes}
    slots: list[Slot | None] = [None] * count
    bandwidth = _Bandwidth()
    busy: dict[str, float] = {}
    ready_heap: list[tuple[float, int, int | None]] = []

    def earliest_start(i: int) -> tuple[float, int | None]:
        inst = instructions[i]
        start, waited_on = lane_free[lane_of[i]]
        for j in deps[i]:
            slot = slots[j]
            assert slot is not None  # i is pushed only once every instruction it depends on is placed
            finish = slot.end + (hw.cross_engine_sync_ns if slot.engine != inst.engine else 0.0)
            if finish > start:
                start, waited_on = finish, j
        for j in issue_after[i]:
            slot = slots[j]
            assert slot is not None
            if slot.start > start:
                start, waited_on = slot.start, j
        return start, waited_on

    def push(i: int) -> None:
        # Pushed only once its dependencies are placed and it heads its lane, so its start is final.
        start, waited_on = earliest_start(i)
        heapq.heappush(ready_heap, (start, i, waited_on))

    def offer(lane: str) -> None:
        members = lanes[lane]
        if position[lane] < len(members) and waiting[members[position[lane]]] == 0:
            push(members[position[lane]])

    for lane in lanes:
        offer(lane)
    while ready_heap:
        start, i, waited_on = heapq.heappop(ready_heap)
        inst = instructions[i]
        if inst.engine == "dma":
            transfer = dma_transfer_ns(inst, hw)
            end, blocker = bandwidth.reserve(start + hw.dma_latency_ns, transfer, i)
            if blocker is not None:
                waited_on = blocker
            busy["dma"] = busy.get("dma", 0.0) + transfer
        else:
            duration = engine_ns(inst, hw)
            end = start + duration
            busy[inst.engine] = busy.get(inst.engine, 0.0) + duration
        slots[i] = Slot(start, end, inst.engine, waited_on)
        lane = lane_of[i]
        lane_free[lane] = (end, i)
        position[lane] += 1
        offer(lane)
        for k in dependents[i]:
            waiting[k] -= 1
            if waiting[k] == 0 and lanes[lane_of[k]][position[lane_of[k]]] == k:
                push(k)
    placed = [s for s in slots if s is not None]
    assert len(placed) == count, "every instruction is placed: dependencies only point to earlier ones"
    return Schedule(slots=placed, engine_busy_ns=busy)
