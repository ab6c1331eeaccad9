"""The scheduler's hazard tracking finds, for every instruction, the same earlier instructions, added
in the same order, as a plain scan of every region each buffer has had written and read."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kernels_neuron.cost.schedule import _Memory
from kernels_neuron.sim.trace import Instruction, Region


class _ScanMemory:
    """The reference: per buffer, the writes as a list and the reads as a dict, scanned in full."""

    def __init__(self) -> None:
        self.writes: dict[int, list[tuple[Region, int]]] = {}
        self.reads: dict[int, dict[Region, int]] = {}

    def access(self, inst: Instruction, idx: int) -> set[int]:
        deps: set[int] = set()
        for region in inst.reads:
            deps.update(i for other, i in self.writes.get(region.buffer_id, ()) if other.overlaps(region))
        for region in inst.writes:
            for other, i in self.writes.get(region.buffer_id, ()):
                if other.overlaps(region):
                    deps.add(i)
            for other, i in self.reads.get(region.buffer_id, {}).items():
                if other.overlaps(region):
                    deps.add(i)
        for region in inst.reads:
            self.reads.setdefault(region.buffer_id, {})[region] = idx
        for region in inst.writes:
            kept = [(other, i) for other, i in self.writes.get(region.buffer_id, ()) if not _inside(other, region)]
            self.writes[region.buffer_id] = [*kept, (region, idx)]
            reads = self.reads.get(region.buffer_id, {})
            for other in [other for other in reads if _inside(other, region)]:
                del reads[other]
        return deps


def _inside(inner: Region, outer: Region) -> bool:
    return outer.p0 <= inner.p0 and inner.p1 <= outer.p1 and outer.b0 <= inner.b0 and inner.b1 <= outer.b1


# Two buffers of a few partitions and bytes: accesses overlap, nest and repeat; an instruction may
# read what it writes, write two regions of one buffer, or write nothing.
_REGIONS = st.builds(
    lambda buffer, p0, pw, b0, bw: Region(buffer, p0, p0 + pw, b0, b0 + bw),
    st.integers(0, 1),
    st.integers(0, 2),
    st.integers(1, 2),
    st.integers(0, 48),
    st.integers(1, 24),
)
_INSTRUCTIONS = st.lists(
    st.tuples(st.lists(_REGIONS, max_size=3), st.lists(_REGIONS, max_size=2)), min_size=20, max_size=120
)


@settings(max_examples=300, deadline=None)
@given(_INSTRUCTIONS)
def test_hazards_match_a_full_scan_in_order(accesses):
    memory, reference = _Memory(), _ScanMemory()
    for i, (reads, writes) in enumerate(accesses):
        inst = Instruction(i, "vector", "tensor_copy", (), tuple(reads), tuple(writes), 1, 1)
        found, expected = memory.access(inst, i), reference.access(inst, i)
        # Built from the same values added in the same order, the sets iterate alike.
        assert list(found) == list(expected), i


def test_an_instruction_that_reads_what_it_writes_does_not_wait_for_itself_and_its_read_is_dropped():
    memory = _Memory()
    tile = Region(3, 0, 128, 0, 512)
    memory.access(Instruction(0, "dma", "dma_copy", (), (), (tile,), 128, 128), 0)
    in_place = Instruction(1, "vector", "tensor_scalar", (), (tile,), (tile,), 128, 128)
    assert memory.access(in_place, 1) == {0}
    assert list(memory.accesses[3][1]._values) == []  # its read lies inside its own write
    assert memory.access(Instruction(2, "vector", "memset", (), (), (tile,), 128, 128), 2) == {1}
