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
from dataclasses import dataclass, field
from typing import NamedTuple

from ..sim.trace import Instruction
from .boxes import BoxIndex
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
    """Where one program's instructions went, in program order: each one's start and end (ns), its
    engine and the instruction it waited on; and each engine's busy time."""

    starts: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    waited_on: list[int | None] = field(default_factory=list)
    engine_busy_ns: dict[str, float] = field(default_factory=dict)

    @property
    def slots(self) -> list[Slot]:
        """Each instruction's placement as one record."""
        return list(map(Slot, self.starts, self.ends, self.engines, self.waited_on))

    @property
    def makespan_ns(self) -> float:
        return max(self.ends, default=0.0)

    def critical_path(self) -> list[int]:
        """Indices of the chain of instructions that ends last, first to last."""
        if not self.ends:
            return []
        i: int | None = self.ends.index(max(self.ends))  # the first of those that end last
        path = []
        while i is not None:
            path.append(i)
            i = self.waited_on[i]
        return path[::-1]


class _Memory:
    """Who last wrote and read each region (program order), pruned as newer writes cover older entries."""

    def __init__(self) -> None:
        self.accesses: dict[int, tuple[BoxIndex, BoxIndex]] = {}  # per buffer: its writes, its reads

    def access(self, inst: Instruction, idx: int) -> set[int]:
        """Record ``inst``'s accesses and return the earlier instructions it must wait for, added in the
        order its accesses are listed."""
        deps: set[int] = set()
        accesses = self.accesses
        reads, writes = inst.reads, inst.writes
        for region in reads:
            known = accesses.get(region[0])
            if known is not None:
                known[0].add_overlapping(deps, region)
        if len(writes) == 1:
            # Most instructions write one region. Nothing after its hazard queries looks at what it
            # covers, so the queries and the dropping of what it covers go in one pass, and its own
            # reads inside it are not recorded (the write would drop them at once).
            (written,) = writes
            _, p0, p1, b0, b1 = written
            known = accesses.get(written[0])
            if known is None:
                known = accesses[written[0]] = (BoxIndex(), BoxIndex())
            else:
                known[0].take_over(deps, written)
                known[1].take_over(deps, written)
            for region in reads:
                if (
                    region[0] == written[0]
                    and p0 <= region[1]
                    and region[2] <= p1
                    and b0 <= region[3]
                    and region[4] <= b1
                ):
                    continue
                read = accesses.get(region[0])
                if read is None:
                    read = accesses[region[0]] = (BoxIndex(), BoxIndex())
                read[1].put(region, idx)
            known[0].put(written, idx)
            return deps
        for region in writes:
            known = accesses.get(region[0])
            if known is not None:
                known[0].add_overlapping(deps, region)
                known[1].add_overlapping(deps, region)
        for region in reads:
            known = accesses.get(region[0])
            if known is None:
                known = accesses[region[0]] = (BoxIndex(), BoxIndex())
            known[1].put(region, idx)
        for region in writes:
            known = accesses.get(region[0])
            if known is None:
                known = accesses[region[0]] = (BoxIndex(), BoxIndex())
            known[0].put_over(region, idx)
            known[1].discard_inside(region)
        return deps


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


# No ``depends_on`` edges. A set union with it still copies the memory dependencies, as the union
# with real edges does, so every instruction's set iterates in the same way: that order decides which
# of two producers that finish at the same moment an instruction is said to have waited on.
_NO_EDGES: frozenset[int] = frozenset()


class _Tables(NamedTuple):
    """What placement needs of each instruction, gathered in one pass over them."""

    deps: list[set[int]]  # the earlier ones it waits for: memory hazards and depends_on edges
    issue_after: list[set[int] | tuple[()]]  # the earlier ones it only starts no earlier than
    engines: list[str]
    durations: list[float]  # engine time, or for a transfer the time it holds the bandwidth


def _tables(instructions: list[Instruction], hw: Hardware) -> _Tables:
    memory = _Memory()
    local_index: dict[int, int] = {}  # trace index -> index in this program, made when an edge needs it
    tables = _Tables([], [], [], [])
    deps, issue_after, engines, durations = tables
    for i, inst in enumerate(instructions):
        attrs = inst.attrs
        explicit, issued = attrs.get("depends_on"), attrs.get("issued_after")
        if (explicit or issued) and not local_index:
            local_index = {other.index: k for k, other in enumerate(instructions)}
        edges = {local_index[j] for j in explicit if j in local_index} if explicit else _NO_EDGES
        waits = memory.access(inst, i) | edges
        deps.append(waits)
        issue_after.append({local_index[j] for j in issued if j in local_index} - waits if issued else ())
        engine = inst.engine
        engines.append(engine)
        durations.append(dma_transfer_ns(inst, hw) if engine == "dma" else engine_ns(inst, hw))
    return tables


def schedule(instructions: list[Instruction], hw: Hardware) -> Schedule:
    """Place one program's instructions in time."""
    count = len(instructions)
    deps, issue_after, engines, durations = _tables(instructions, hw)

    # Each engine, and each DMA queue (transfers go round-robin onto them), is an in-order lane.
    lane_ids: dict[str | int, int] = {}
    lanes: list[list[int]] = []
    lane_of = [0] * count
    transfers = 0
    for i, engine in enumerate(engines):
        if engine == "dma":
            key: str | int = transfers % hw.dma_queues
            transfers += 1
        else:
            key = engine
        lane = lane_ids.get(key)
        if lane is None:
            lane = lane_ids[key] = len(lanes)
            lanes.append([])
        lane_of[i] = lane
        lanes[lane].append(i)

    position = [0] * len(lanes)  # how many of each lane's instructions are placed
    lane_end = [0.0] * len(lanes)  # when each lane is free, and who it waits for until then
    lane_last: list[int | None] = [None] * len(lanes)
    placed = [False] * count
    starts = [0.0] * count
    ends = [0.0] * count
    waits_on: list[int | None] = [None] * count
    # Instructions that head their lane but wait for this one to be placed (each waits for one at a time).
    watchers: list[list[int] | None] = [None] * count
    bandwidth = _Bandwidth()
    busy: dict[str, float] = {}
    ready_heap: list[tuple[float, int, int | None]] = []
    sync_ns, dma_latency_ns = hw.cross_engine_sync_ns, hw.dma_latency_ns

    def offer(i: int) -> None:
        """``i`` heads its lane: once every instruction it depends on is placed its start is final, and it
        goes on the heap; until then it waits for the first one that is not."""
        lane = lane_of[i]
        start, waited_on = lane_end[lane], lane_last[lane]
        engine = engines[i]
        for j in deps[i]:
            if not placed[j]:
                break
            finish = ends[j] + (sync_ns if engines[j] != engine else 0.0)
            if finish > start:
                start, waited_on = finish, j
        else:
            for j in issue_after[i]:
                if not placed[j]:
                    break
                if starts[j] > start:
                    start, waited_on = starts[j], j
            else:
                heapq.heappush(ready_heap, (start, i, waited_on))
                return
        waiting = watchers[j]
        if waiting is None:
            watchers[j] = [i]
        else:
            waiting.append(i)

    for members in lanes:
        offer(members[0])
    count_placed = 0
    while ready_heap:
        start, i, waited_on = heapq.heappop(ready_heap)
        engine = engines[i]
        duration = durations[i]
        if engine == "dma":
            end, blocker = bandwidth.reserve(start + dma_latency_ns, duration, i)
            if blocker is not None:
                waited_on = blocker
        else:
            end = start + duration
        busy[engine] = busy.get(engine, 0.0) + duration
        starts[i], ends[i], waits_on[i] = start, end, waited_on
        placed[i] = True
        count_placed += 1
        lane = lane_of[i]
        lane_end[lane], lane_last[lane] = end, i
        position[lane] += 1
        members = lanes[lane]
        if position[lane] < len(members):
            offer(members[position[lane]])
        waiting = watchers[i]
        if waiting is not None:
            watchers[i] = None
            for k in waiting:
                offer(k)
    assert count_placed == count, "every instruction is placed: dependencies only point to earlier ones"
    return Schedule(starts, ends, engines, waits_on, busy)
