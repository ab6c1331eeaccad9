"""On-chip memory as the compiler and the hardware see it: how much SBUF and PSUM a program's tiles
need, and where tiles placed at explicit addresses sit.

Capacity. The compiler gives a tile (``nl.ndarray`` without ``address=``) its space for as long as the
tile holds data the kernel still needs and recycles it afterwards (AWS's tiling overview: tiles "will
be automatically recycled by the compiler when no longer needed"). So a tile occupies its bytes per
partition from the first instruction that touches it to the last one, and a tile no instruction
touches occupies none. It occupies only the partitions it takes: the architecture guide says the
compiler's tensor allocator starts a tile of 33..64 partitions at partition 0 or 64 and a smaller one at
0, 32, 64 or 96, and the model gives each tile the legal place holding the fewest bytes when its span
starts (the real allocator's choice is not documented). A tile placed with ``address=(partition,
byte)`` occupies those bytes over the same span; placed tiles that share bytes count them once. When a program ends, the peak over its
instructions is checked against the target's capacity (a single tile larger than the capacity, or a
placed tile reaching outside the memory, is refused at once).

Aliasing. Placed tiles keep their own storage in the simulator, but their trace regions are those of
the physical memory, so the cost model's scheduler sees the hazards between tiles sharing bytes. Each
physical byte remembers which placed tile last wrote it: a tile reading bytes it wrote that another
tile has written since would, on hardware, read the other tile's data; that raises ``AliasingError``.
"""

from __future__ import annotations

import heapq
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .errors import AliasingError, CapacityError, CapacityWarning
from .targets import Target
from .trace import Region, Trace

if TYPE_CHECKING:
    from .runtime import Buffer
    from .tensor import Tensor

ON_CHIP = ("sbuf", "psum")
QUADRANT = 32  # partitions: the unit of the start-partition rule


class Placement(NamedTuple):
    """Where ``nl.ndarray(address=...)`` put an on-chip tile in its core's physical SBUF or PSUM."""

    memory_id: int  # the Region buffer id the run gives that physical memory
    partition: int  # the tile's first partition
    byte: int  # the byte within each partition where the tile's row starts


class TileUsage:
    """The span of instructions (trace indices) over which one on-chip tile holds its bytes."""

    __slots__ = ("nbytes", "partitions", "first", "last", "box", "label")

    def __init__(self, nbytes: int, partitions: int, box: tuple[int, int, int, int] | None, label: str) -> None:
        self.nbytes = nbytes  # bytes per partition
        self.partitions = partitions
        self.first: int | None = None
        self.last = -1
        self.box = box  # (p0, p1, b0, b1) in physical memory for a placed tile, else None
        self.label = label


class OnChipMemory:
    """One program's SBUF and PSUM: tile spans, placements and the aliasing checks."""

    def __init__(self, target: Target, trace: Trace, capacity: str, new_id: Any) -> None:
        self.target = target
        self.trace = trace
        self.capacity = capacity  # "error" or "warn"
        self._new_id = new_id
        self._usages: dict[str, list[TileUsage]] = {kind: [] for kind in ON_CHIP}
        self._memory_ids: dict[str, int] = {}
        self._last_writer: dict[str, np.ndarray] = {}  # per physical byte: the placed tile that last wrote it

    def limit(self, kind: str) -> int:
        return self.target.sbuf_bytes_per_partition if kind == "sbuf" else self.target.psum_bytes_per_partition

    def allocate(self, buf: Buffer, address: tuple[int, int] | None, what: str) -> None:
        """Account for a new on-chip tile; ``address`` (partition, byte) places it."""
        kind, partitions, row = buf.kind, buf.data.shape[0], buf.partition_bytes
        limit = self.limit(kind)
        box = None
        if address is None:
            if row > limit:
                self._over(
                    f"nl.ndarray: {what}: one tile needs {row:,} bytes per partition, over the {limit:,}-byte "
                    f"{kind.upper()} capacity of {self.target.name}",
                    kind,
                    row,
                )
        else:
            partition, byte = address
            if partition + partitions > self.target.partitions or byte + row > limit:
                raise CapacityError(
                    f"nl.ndarray: {what}: address: a tile of {partitions} partitions x {row:,} bytes at "
                    f"(partition {partition}, byte {byte:,}) ends at (partition {partition + partitions}, byte "
                    f"{byte + row:,}), outside {self.target.name}'s {kind.upper()} of {self.target.partitions} "
                    f"partitions x {limit:,} bytes"
                )
            if kind not in self._memory_ids:
                self._memory_ids[kind] = self._new_id()
                self._last_writer[kind] = np.zeros((self.target.partitions, 0), dtype=np.int32)
            writers = self._last_writer[kind]
            if writers.shape[1] < byte + row:  # only as wide as the placed tiles reach
                grown = np.zeros((self.target.partitions, byte + row), dtype=np.int32)
                grown[:, : writers.shape[1]] = writers
                self._last_writer[kind] = grown
            buf.placement = Placement(self._memory_ids[kind], partition, byte)
            buf.written_bytes = np.zeros((partitions, row), dtype=bool)
            box = (partition, partition + partitions, byte, byte + row)
        buf.usage = TileUsage(row, partitions, box, what)
        self._usages[kind].append(buf.usage)

    def touch(
        self, op: str, reads: Sequence[tuple[str, Tensor]], writes: Sequence[tuple[str, Tensor]], index: int
    ) -> None:
        """Instruction ``index`` reads and writes these operands: extend their tiles' spans, and check
        and record what placed tiles read and write."""
        placed = False
        for _, t in (*reads, *writes):
            usage = t._buf.usage
            if usage is not None:
                if usage.first is None:
                    usage.first = index
                usage.last = index
                placed = placed or usage.box is not None
        if placed:
            self._check_aliasing(op, reads, writes)

    def _check_aliasing(
        self, op: str, reads: Sequence[tuple[str, Tensor]], writes: Sequence[tuple[str, Tensor]]
    ) -> None:
        """A placed tile that reads bytes it wrote, which another tile placed over it has written
        since, would read that tile's data on hardware. (Bytes a tile never wrote read as
        uninitialized, as anywhere in the simulator: kernels often read a whole tile and use only
        its valid part.)"""
        for role, t in reads:
            buf, written = t._buf, t._buf.written_bytes
            if buf.placement is None or written is None:
                continue
            touched = _touched(t)
            if touched is None:
                continue
            rows, cols = touched
            owners = self._last_writer[buf.kind][_shifted(rows, cols, buf.placement)]
            clobbered = written[rows, cols] & (owners != buf.id)
            if clobbered.any():
                region = t.region()
                raise AliasingError(
                    f"nisa.{op}: {role}: {t!r} at (partition {buf.placement.partition}, byte "
                    f"{buf.placement.byte:,}) reads bytes it wrote that another tile placed over it has written "
                    f"since (buffer #{int(owners[clobbered].flat[0])}; this tile is #{buf.id}), within partitions "
                    f"[{region.p0}, {region.p1}), bytes [{region.b0}, {region.b1})"
                )
        for _, t in writes:
            buf, written = t._buf, t._buf.written_bytes
            if buf.placement is None or written is None:
                continue
            touched = _touched(t)
            if touched is not None:
                rows, cols = touched
                self._last_writer[buf.kind][_shifted(rows, cols, buf.placement)] = buf.id
                written[rows, cols] = True

    def finish(self) -> None:
        """The program ended: record each memory's peak in the trace and check it fits."""
        for kind in ON_CHIP:
            peak, at = _peak(self._usages[kind], self.target.partitions)
            self._note_peak(kind, peak)
            limit = self.limit(kind)
            if peak > limit:
                live = sorted((u for u in self._usages[kind] if _spans(u, at)), key=lambda u: -u.nbytes)
                shown = ", ".join(f"{u.label} {u.nbytes:,} B" for u in live[:4])
                more = f" and {len(live) - 4} more" if len(live) > 4 else ""
                where = self.trace.instructions[at]
                self._over(
                    f"nki.jit: live {kind.upper()} peaks at {peak:,} bytes per partition at instruction {at} "
                    f"(nisa.{where.op}, program {list(where.program)}, rank {where.rank}), over the {limit:,}-byte "
                    f"capacity of {self.target.name}; live there: {shown}{more}",
                    kind,
                    peak,
                )

    def _note_peak(self, kind: str, nbytes: int) -> None:
        """Raise the trace's peak of ``kind`` (SBUF or PSUM bytes per partition) to ``nbytes``."""
        field = "sbuf_peak_bytes" if kind == "sbuf" else "psum_peak_bytes"
        setattr(self.trace, field, max(getattr(self.trace, field), nbytes))

    def _over(self, message: str, kind: str, nbytes: int) -> None:
        self._note_peak(kind, nbytes)
        if self.capacity == "error":
            raise CapacityError(message)
        warnings.warn(message, CapacityWarning, stacklevel=4)


def _spans(usage: TileUsage, index: int) -> bool:
    return usage.first is not None and usage.first <= index <= usage.last


def _quadrants(partitions: int, total: int) -> list[range]:
    """Where the compiler may put a tile of ``partitions`` partitions, as ranges of 32-partition quadrants:
    the architecture guide's start-partition rule (over 64 partitions from 0; 33..64 from 0 or 64; up to
    32 from 0, 32, 64 or 96), which it says the compiler's tensor allocator follows."""
    span = -(-partitions // QUADRANT)
    starts = (0,) if partitions > 2 * QUADRANT else (0, 2) if partitions > QUADRANT else range(total // QUADRANT)
    return [range(start, start + span) for start in starts]


def _peak(usages: list[TileUsage], partitions: int) -> tuple[int, int]:
    """The most bytes per partition the tiles hold at once, and the first instruction where they do:
    swept over the instructions where a span starts (the peak is at one of them). A tile counts on the
    partitions it takes: one placed at an address on its own, one the compiler places on the legal
    quadrants (``_quadrants``) that hold the fewest bytes when its span starts."""
    used = sorted((u for u in usages if u.first is not None), key=lambda u: u.first)  # type: ignore[arg-type,return-value]
    ending: list[tuple[int, int]] = []  # (last, position in ``used``) of the spans still open
    placed: dict[int, tuple[int, int, int, int]] = {}
    chosen: dict[int, range] = {}  # quadrants of the compiler-placed tiles still open
    load = [0] * (partitions // QUADRANT)  # their bytes per partition, by quadrant
    best, at = 0, -1
    for position, usage in enumerate(used):
        start = usage.first
        assert start is not None
        while ending and ending[0][0] < start:
            _, gone = heapq.heappop(ending)
            if used[gone].box is None:
                for q in chosen.pop(gone):
                    load[q] -= used[gone].nbytes
            else:
                del placed[gone]
        heapq.heappush(ending, (usage.last, position))
        if usage.box is None:
            quadrants = min(_quadrants(usage.partitions, partitions), key=lambda qs: max(load[q] for q in qs))
            chosen[position] = quadrants
            for q in quadrants:
                load[q] += usage.nbytes
        else:
            placed[position] = usage.box
        total = max(load[q] + _placed_bytes(list(placed.values()), q) for q in range(len(load)))
        if total > best:
            best, at = total, start
    return best, at


def _placed_bytes(boxes: list[tuple[int, int, int, int]], quadrant: int) -> int:
    """Bytes per partition the placed tiles' boxes cover on the fullest partition of a quadrant."""
    lo, hi = quadrant * QUADRANT, (quadrant + 1) * QUADRANT
    inside = [(max(p0, lo), min(p1, hi), b0, b1) for p0, p1, b0, b1 in boxes if p0 < hi and lo < p1]
    return _union_bytes(inside) if inside else 0


def _union_bytes(boxes: list[tuple[int, int, int, int]]) -> int:
    """Bytes per partition the boxes (p0, p1, b0, b1) cover on their fullest partition."""
    cuts = sorted({p for box in boxes for p in box[:2]})
    fullest = 0
    for lo, hi in zip(cuts, cuts[1:]):
        covered = end = 0
        for b0, b1 in sorted((box[2], box[3]) for box in boxes if box[0] < hi and lo < box[1]):
            covered += max(0, b1 - max(b0, end))
            end = max(end, b1)
        fullest = max(fullest, covered)
    return fullest


# Region(...) without the NamedTuple constructor's argument handling: every view of a tile makes one.
_new_region = tuple.__new__


def box_of(buf: Buffer, view: np.ndarray, start: int) -> Region:
    """The partition/byte box ``view`` touches inside ``buf``'s own storage; its first element lies
    ``start`` bytes into that storage."""
    shape, strides = view.shape, view.strides
    if 0 in shape:
        return _new_region(Region, (buf.id, 0, 0, 0, 0))
    # The bytes one partition's elements span, relative to the view's first element (the free dims; a
    # negative stride reaches below it), then the partition dim's span on top.
    free_lo, free_hi = 0, view.itemsize
    for n, s in zip(shape[1:], strides[1:]):
        if s < 0:
            free_lo += (n - 1) * s
        else:
            free_hi += (n - 1) * s
    span = (shape[0] - 1) * strides[0] if shape else 0
    lo, hi = start + free_lo + min(span, 0), start + free_hi + max(span, 0)
    if not buf.on_chip:
        return _new_region(Region, (buf.id, 0, 1, lo, hi))
    row = buf.partition_bytes
    p0, p1 = lo // row, (hi - 1) // row + 1
    if p1 - p0 == 1:
        return _new_region(Region, (buf.id, p0, p1, lo - p0 * row, hi - p0 * row))
    first = start % row
    return _new_region(Region, (buf.id, p0, p1, max(first + free_lo, 0), min(first + free_hi, row)))


def region_of(buf: Buffer, view: np.ndarray, start: int) -> Region:
    """The partition/byte box ``view`` (its first element ``start`` bytes into ``buf``'s storage)
    touches: inside ``buf``, or for a tile placed at an explicit address, inside the physical memory
    there."""
    box = box_of(buf, view, start)
    placement = buf.placement
    if placement is None:
        return box
    p, b = placement.partition, placement.byte
    return _new_region(Region, (placement.memory_id, box.p0 + p, box.p1 + p, box.b0 + b, box.b1 + b))


def _touched(t: Tensor) -> tuple[Any, Any] | None:
    """Index of the bytes a view of an on-chip tile touches, into a [partition, byte] array of the
    tile: its box when the view covers it whole, else the bytes of each element (a strided view's box
    also holds bytes it skips). For an ``.indirect()`` view, the bytes of the columns its offsets pick;
    None while those offsets are uncomputed (a trace-only run cannot tell them)."""
    buf, columns = t._buf, t._columns
    if columns is not None:
        if not columns.index_known():
            return None
        view = columns.base._view
        picked = np.asarray(columns.base.byte_offset())
        for index, stride in zip(columns.targets(), view.strides):
            picked = picked + index * stride
        return _element_bytes(picked.reshape(-1), view.itemsize, buf.partition_bytes)
    view, start = t._view, t.byte_offset()
    box = box_of(buf, view, start)
    if view.size * view.itemsize == (box.p1 - box.p0) * (box.b1 - box.b0):
        return slice(box.p0, box.p1), slice(box.b0, box.b1)
    offsets = np.array([start])
    for n, stride in zip(view.shape, view.strides):
        offsets = (offsets[:, None] + np.arange(n) * stride).reshape(-1)
    return _element_bytes(offsets, view.itemsize, buf.partition_bytes)


def _element_bytes(offsets: np.ndarray, itemsize: int, row: int) -> tuple[np.ndarray, np.ndarray]:
    """(partition, byte) of every byte of the elements starting at these byte offsets in a tile."""
    every = (offsets[:, None] + np.arange(itemsize)).reshape(-1)
    return every // row, every % row


def _shifted(rows: Any, cols: Any, placement: Placement) -> tuple[Any, Any]:
    """A tile's byte index (``_touched``) moved to where the tile sits in physical memory."""
    p, b = placement.partition, placement.byte
    if isinstance(rows, slice):
        return slice(rows.start + p, rows.stop + p), slice(cols.start + b, cols.stop + b)
    return rows + p, cols + b
