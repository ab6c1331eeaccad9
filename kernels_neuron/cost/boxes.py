"""Regions of one buffer's memory, each with a value, found by overlap or containment.

The scheduler keeps, per buffer, who last wrote and who last read each region. A buffer written
tile by tile (an HBM output, a wide SBUF accumulator) collects thousands of regions, and every
access asks which of them it overlaps, so scanning them all makes the dependency pass quadratic.
Past a few dozen regions, :class:`BoxIndex` files them by width class (byte widths in
``[2**(k-1), 2**k)``), each class sorted by first byte: a region of class ``k`` that overlaps
``[b0, b1)`` starts in ``(b0 - 2**k, b1)``, so a query bisects to the few candidates of each class.

Answers come in insertion order, the order the scheduler's dependency sets were built in before this
index existed (the iteration order of those sets decides which of two equally late producers a
schedule names as the one an instruction waited for).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from ..sim.trace import Region

# Up to this many regions a buffer's are scanned in insertion order; beyond it they are filed by
# width class when next asked about. Measured on six bench traces: limits of 12 to 32 came within a
# few percent of each other, and 40 was up to a quarter slower on two of them.
LINEAR_LIMIT = 24


def _width_class(b0: int, b1: int) -> int:
    """``k`` for a byte width in ``[2**(k-1), 2**k)``; 0 for an empty (or inverted) range."""
    return (b1 - b0).bit_length() if b1 > b0 else 0


class BoxIndex:
    """Regions of one buffer (partitions ``[p0, p1)`` x bytes ``[b0, b1)``), each with an int value,
    kept in insertion order. The regions' buffer ids are not looked at."""

    __slots__ = ("_values", "_classes", "_next_sequence", "_answers")

    def __init__(self) -> None:
        # Every region's value, in insertion order (a dict keeps it, through deletions and updates too).
        self._values: dict[Region, int] = {}
        # Once past LINEAR_LIMIT: per width class, the regions' first bytes (sorted) and, in the same
        # order, each region with its sequence number (the insertion order, to sort answers by).
        self._classes: dict[int, tuple[list[int], list[tuple[Region, int]]]] | None = None
        self._next_sequence = 0
        # Once filed, add_overlapping's answers while the regions and their values stay as they are: a
        # tile written once is often read by many instructions in a row (a matmul's stationary operand).
        self._answers: dict[Region, tuple[int, ...]] | None = None

    def __len__(self) -> int:
        return len(self._values)

    def put(self, region: Region, value: int) -> None:
        """Give ``region`` this value: a region already present keeps its place, a new one goes last."""
        values = self._values
        if self._classes is None:
            values[region] = value
            return
        if self._answers:
            self._answers.clear()
        if region in values:
            values[region] = value
        else:
            values[region] = value
            self._file(region)

    def put_over(self, region: Region, value: int) -> None:
        """Remove every region inside ``region``, then add ``region`` last with this value."""
        if self._values:
            self.discard_inside(region)
        self.put(region, value)

    def _build_classes(self) -> None:
        """File the regions: at the first question asked once there are more than LINEAR_LIMIT, so a
        buffer that grows large but is not asked about again is never filed."""
        by_class: dict[int, list[tuple[int, int, Region]]] = {}
        for sequence, region in enumerate(self._values):
            _, _, _, b0, b1 = region
            by_class.setdefault(_width_class(b0, b1), []).append((b0, sequence, region))
        self._classes = {}
        for width_class, members in by_class.items():
            members.sort()
            self._classes[width_class] = ([b0 for b0, _, _ in members], [(r, seq) for _, seq, r in members])
        self._answers = {}
        self._next_sequence = len(self._values)

    def _file(self, region: Region) -> None:
        assert self._classes is not None
        _, _, _, b0, b1 = region
        starts, members = self._classes.setdefault(_width_class(b0, b1), ([], []))
        at = bisect_right(starts, b0)
        starts.insert(at, b0)
        members.insert(at, (region, self._next_sequence))
        self._next_sequence += 1

    def add_overlapping(self, found: set[int], region: Region) -> None:
        """Add to ``found``, in insertion order, the value of every region that overlaps ``region``."""
        if self._classes is None and len(self._values) > LINEAR_LIMIT:
            self._build_classes()
        if self._classes is None:
            _, p0, p1, b0, b1 = region
            for (_, q0, q1, c0, c1), value in self._values.items():
                if p0 < q1 and q0 < p1 and b0 < c1 and c0 < b1:
                    found.add(value)
            return
        answers = self._answers
        assert answers is not None
        answer = answers.get(region)
        if answer is None:
            answer = answers[region] = self._filed_overlapping(region)
        for value in answer:
            found.add(value)

    def _filed_overlapping(self, region: Region) -> tuple[int, ...]:
        assert self._classes is not None
        _, p0, p1, b0, b1 = region
        values = self._values
        hits = []
        for width_class, (starts, members) in self._classes.items():
            if width_class:
                # A region of this class is narrower than 2**k: if it ends after b0 it starts after b0 - 2**k.
                candidates = members[bisect_right(starts, b0 - (1 << width_class)) : bisect_left(starts, b1)]
            else:
                candidates = members
            for other, sequence in candidates:
                _, q0, q1, c0, c1 = other
                if p0 < q1 and q0 < p1 and b0 < c1 and c0 < b1:
                    hits.append((sequence, values[other]))
        if len(hits) > 1:
            hits.sort()
        return tuple(value for _, value in hits)

    def take_over(self, found: set[int], region: Region) -> None:
        """``add_overlapping`` then ``discard_inside``, in one pass over the regions while they are few."""
        if self._classes is None and len(self._values) > LINEAR_LIMIT:
            self._build_classes()
        if self._classes is not None:
            for value in self._filed_overlapping(region):
                found.add(value)
            self.discard_inside(region)
            return
        _, p0, p1, b0, b1 = region
        values = self._values
        inside = []
        for other, value in values.items():
            _, q0, q1, c0, c1 = other
            if p0 < q1 and q0 < p1 and b0 < c1 and c0 < b1:
                found.add(value)
            if p0 <= q0 and q1 <= p1 and b0 <= c0 and c1 <= b1:
                inside.append(other)
        for other in inside:
            del values[other]

    def discard_inside(self, region: Region) -> None:
        """Remove every region that lies inside ``region`` (``region`` itself among them)."""
        _, p0, p1, b0, b1 = region
        values = self._values
        if self._classes is None and len(values) > LINEAR_LIMIT:
            self._build_classes()
        if self._classes is None:
            for other in [o for o in values if p0 <= o[1] and o[2] <= p1 and b0 <= o[3] and o[4] <= b1]:
                del values[other]
            return
        emptied = []
        removed = False
        for width_class, (starts, members) in self._classes.items():
            # A region at least a byte wide that lies inside [b0, b1) starts in [b0, b1).
            lo, hi = (bisect_left(starts, b0), bisect_left(starts, b1)) if width_class else (0, len(members))
            kept = []
            for member in members[lo:hi]:
                _, q0, q1, c0, c1 = other = member[0]
                if p0 <= q0 and q1 <= p1 and b0 <= c0 and c1 <= b1:
                    del values[other]
                else:
                    kept.append(member)
            if len(kept) < hi - lo:
                removed = True
                members[lo:hi] = kept
                starts[lo:hi] = [member[0][3] for member in kept]
                if not members:
                    emptied.append(width_class)
        if not removed:
            return
        for width_class in emptied:
            del self._classes[width_class]
        if len(values) <= LINEAR_LIMIT // 2:
            self._classes = self._answers = None  # few enough again to scan
        else:
            assert self._answers is not None
            self._answers.clear()
