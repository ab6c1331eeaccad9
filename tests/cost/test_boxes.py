"""BoxIndex answers exactly as a scan of its regions in insertion order would, before and after it
starts filing them by width class."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_neuron.cost.boxes import LINEAR_LIMIT, BoxIndex
from kernels_neuron.sim.trace import Region


class _Scan:
    """The reference: a dict in insertion order, scanned in full."""

    def __init__(self) -> None:
        self.values: dict[Region, int] = {}

    def put(self, region: Region, value: int) -> None:
        self.values[region] = value

    def discard_inside(self, region: Region) -> None:
        for inner in [r for r in self.values if _inside(r, region)]:
            del self.values[inner]

    def put_over(self, region: Region, value: int) -> None:
        self.discard_inside(region)
        self.put(region, value)

    def overlapping(self, region: Region) -> list[int]:
        found: list[int] = []
        for other, value in self.values.items():
            if _overlaps(other, region) and value not in found:
                found.append(value)
        return found


def _overlaps(a: Region, b: Region) -> bool:
    return a.p0 < b.p1 and b.p0 < a.p1 and a.b0 < b.b1 and b.b0 < a.b1


def _inside(inner: Region, outer: Region) -> bool:
    return outer.p0 <= inner.p0 and inner.p1 <= outer.p1 and outer.b0 <= inner.b0 and inner.b1 <= outer.b1


def _regions():
    # Few partitions and bytes, so that regions touch, nest, repeat and overlap often; widths span
    # several width classes, and empty and inverted byte ranges occur.
    return st.builds(
        lambda p0, pw, b0, bw: Region(7, p0, p0 + pw, b0, b0 + bw),
        st.integers(0, 3),
        st.integers(0, 3),
        st.integers(0, 80),
        st.one_of(st.integers(-2, 3), st.integers(4, 40)),  # narrow ones often: one byte is a class of its own
    )


# Operations on regions drawn from a small pool, so that the same region is asked about, put, and
# taken over again and again (what the answer cache of a filed index has to keep up with).
_OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["put", "put_over", "discard_inside", "query", "take_over"]), st.integers(0, 10**6)),
    max_size=200,
)


class _Added(list):
    """Stands in for the set ``add_overlapping`` fills, remembering the order values were added in."""

    def add(self, value: int) -> None:
        if value not in self:
            self.append(value)


def _overlapping(index: BoxIndex, region: Region) -> list[int]:
    added = _Added()
    index.add_overlapping(added, region)  # type: ignore[arg-type]
    return list(added)


def _check(filled: list[Region], pool: list[Region], operations: list[tuple[str, int]]) -> None:
    index, reference = BoxIndex(), _Scan()
    for step, region in enumerate(filled):
        index.put(region, step)
        reference.put(region, step)
    for step, (operation, which) in enumerate(operations, start=len(filled)):
        region = pool[which % len(pool)]
        if operation == "query":
            # The same values, first added in the same order (so a set built from them iterates alike).
            assert _overlapping(index, region) == reference.overlapping(region), (step, region)
        elif operation == "take_over":
            added = _Added()
            index.take_over(added, region)  # type: ignore[arg-type]
            assert list(added) == reference.overlapping(region), (step, region)
            reference.discard_inside(region)
        elif operation == "discard_inside":
            index.discard_inside(region)
            reference.discard_inside(region)
        else:
            getattr(index, operation)(region, step)
            getattr(reference, operation)(region, step)
        assert list(index._values.items()) == list(reference.values.items()), step


@settings(max_examples=300, deadline=None)
@given(st.lists(_regions(), min_size=1, max_size=60), _OPERATIONS)
def test_box_index_answers_as_a_scan_in_insertion_order(pool, operations):
    _check([], pool, operations)


@settings(max_examples=150, deadline=None)
@given(st.lists(_regions(), min_size=LINEAR_LIMIT + 1, max_size=2 * LINEAR_LIMIT, unique=True), _OPERATIONS)
def test_a_filed_index_answers_as_a_scan(filled, operations):
    """Filled with more distinct regions than LINEAR_LIMIT first, so the operations run on the
    width-class index (and go back to scanning if enough are discarded)."""
    _check(filled, filled, operations)


def test_a_filed_index_answers_again_after_a_change():
    index = BoxIndex()
    columns = [Region(1, 0, 128, 64 * i, 64 * (i + 1)) for i in range(LINEAR_LIMIT + 8)]
    for i, column in enumerate(columns):
        index.put(column, i)
    assert _overlapping(index, columns[3]) == [3]
    index.put(columns[3], 1000)  # a new last writer of the same region
    assert _overlapping(index, columns[3]) == [1000]
    index.put(Region(1, 0, 64, 64 * 3 + 8, 64 * 3 + 16), 2000)  # a new region inside it
    assert _overlapping(index, columns[3]) == [1000, 2000]
    index.discard_inside(columns[3])
    assert _overlapping(index, columns[3]) == []


def test_regions_that_only_touch_do_not_overlap_in_a_filed_index():
    index = BoxIndex()
    for i in range(LINEAR_LIMIT + 8):  # 64-byte columns of a 128-partition tile, side by side
        index.put(Region(1, 0, 128, 64 * i, 64 * (i + 1)), i)
    assert _overlapping(index, Region(1, 0, 128, 64 * 5, 64 * 6)) == [5]
    assert _overlapping(index, Region(1, 0, 128, 64 * 5 - 1, 64 * 6 + 1)) == [4, 5, 6]  # a byte into each neighbour


def test_a_region_put_again_keeps_its_place_in_insertion_order():
    index = BoxIndex()
    regions = [Region(1, 0, 128, 16 * i, 16 * i + 16) for i in range(LINEAR_LIMIT + 4)]
    for i, region in enumerate(reversed(regions)):  # the last bytes first
        index.put(region, i)
    index.put(regions[-1], 99)  # a new value for the first region put: still found first
    whole = Region(1, 0, 128, 0, 16 * len(regions))
    assert _overlapping(index, whole) == [99, *range(1, len(regions))]
    index.put_over(regions[-1], 100)  # removed and put again: now last
    assert _overlapping(index, whole) == [*range(1, len(regions)), 100]
