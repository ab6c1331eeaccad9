"""On-chip memory (``kernels_neuron/sim/memory.py``): a tile holds its SBUF/PSUM bytes from the first
instruction that touches it to the last, as the compiler recycles a tile's space after its last use;
tiles placed with ``nl.ndarray(address=...)`` sit at that partition and byte of the physical memory,
share bytes they overlap (counted once), are traced at their physical regions, and a placed tile
reading bytes it wrote that another tile has overwritten since raises ``AliasingError``."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_neuron import cost, sim
from kernels_neuron.cost.schedule import schedule
from kernels_neuron.sim import isa as nisa
from kernels_neuron.sim import language as nl

DUMMY = np.zeros((1, 1), np.float32)
F32, BF16 = nl.float32, nl.bfloat16


def sb(shape, dtype=F32, name="", address=None):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf, name=name, address=address)


def ps(shape, dtype=F32, name="", address=None):
    return nl.ndarray(shape, dtype, buffer=nl.psum, name=name, address=address)


def nested(tiles):
    """Touch each tile, then each again in reverse order, so every span covers the middle."""
    for t in [*tiles, *reversed(tiles)]:
        nisa.memset(t, 0.0)


# -- capacity: spans of use -----------------------------------------------------------------------
def test_peak_bytes_per_partition_are_exact():
    def kernel(x):
        # 4096 B on every partition, 200 B on partitions 0..63 (the first fit of a 64-partition tile),
        # 15 B on the 2 partitions of the emptiest quadrant (64..95): 4296 on the fullest partition.
        nested([sb((128, 1024)), sb((64, 100), BF16), sb((2, 3, 5), nl.int8)])
        nl.ndarray((128, 100000), F32, buffer=nl.shared_hbm)  # HBM: not counted
        nested([ps((128, 512)), ps((128, 2, 128))])  # 2048 + 1024 B

    trace = sim.run(kernel, DUMMY).trace
    assert trace.sbuf_peak_bytes == 4096 + 200
    assert trace.psum_peak_bytes == 2048 + 1024


@pytest.mark.parametrize("tiles, peak", [(2, 120000), (3, 240000)])
def test_tiles_of_up_to_64_partitions_take_the_emptier_half(tiles, peak):
    """The compiler's allocator may start a 33..64-partition tile at partition 0 or 64 (the architecture
    guide's start-partition rule, which it says the allocator follows): two such tiles of 120,000 B fit
    side by side; a third shares a half and overflows."""

    def kernel(x):
        nested([sb((64, 30000), name=f"t{i}") for i in range(tiles)])

    if peak <= 229376:
        assert sim.run(kernel, DUMMY).trace.sbuf_peak_bytes == peak
    else:
        with pytest.raises(sim.CapacityError, match=rf"live SBUF peaks at {peak:,} bytes per partition"):
            sim.run(kernel, DUMMY)


def test_a_tiles_space_is_free_after_its_last_use():
    def kernel(x):
        kept = []
        for _ in range(5):
            t = sb((128, 20000))  # 80,000 B each: five at once would overflow
            nisa.memset(t, 0.0)
            kept.append(t)  # still referenced, but never used again

    assert sim.run(kernel, DUMMY).trace.sbuf_peak_bytes == 80000


def test_a_tile_no_instruction_touches_takes_no_space():
    def kernel(x):
        _unused = sb((128, 50000))

    assert sim.run(kernel, DUMMY).trace.sbuf_peak_bytes == 0


def test_a_tile_larger_than_the_memory_is_refused_at_once():
    def kernel(x):
        sb((128, 60000), name="huge")

    with pytest.raises(
        sim.CapacityError, match=r"nl\.ndarray: huge \(128, 60000\): one tile needs 240,000 bytes per partition"
    ):
        sim.run(kernel, DUMMY)


def _two_big_tiles(x):
    a, b = sb((128, 30000), name="a"), sb((128, 30000), name="b")
    nisa.memset(a, 1.0)
    nisa.memset(b, 2.0)
    nisa.tensor_copy(dst=b, src=a)  # a is still needed while b lives


def test_overlapping_spans_over_the_capacity_are_an_error_naming_the_tiles():
    with pytest.raises(
        sim.CapacityError,
        match=r"live SBUF peaks at 240,000 bytes per partition at instruction 1 \(nisa\.memset, program \[0\], "
        r"rank 0\), over the 229,376-byte capacity of trn2; live there: a \(128, 30000\) 120,000 B, "
        r"b \(128, 30000\) 120,000 B",
    ):
        sim.run(_two_big_tiles, DUMMY)
    assert issubclass(sim.CapacityError, sim.NkiValidationError)


def test_overflow_only_warns_when_asked():
    with pytest.warns(sim.CapacityWarning, match=r"live SBUF peaks at 240,000 bytes per partition"):
        result = sim.run(_two_big_tiles, DUMMY, capacity="warn")
    assert result.trace.sbuf_peak_bytes == 240000
    assert [i.op for i in result.trace] == ["memset", "memset", "tensor_copy"]


def test_sbuf_fits_exactly_at_capacity():
    def kernel(x):
        nisa.memset(sb((128, 224 * 1024 // 4)), 0.0)

    assert sim.run(kernel, DUMMY).trace.sbuf_peak_bytes == 229376


def test_trn1_sbuf_is_smaller_than_trn2():
    def kernel(x):
        nisa.memset(sb((128, 50000)), 0.0)  # 200,000 B per partition

    assert sim.run(kernel, DUMMY, target="trn2").trace.sbuf_peak_bytes == 200000
    with pytest.raises(sim.CapacityError, match=r"one tile needs 200,000 bytes per partition, over the 196,608"):
        sim.run(kernel, DUMMY, target="trn1")


def test_psum_overflow():
    def kernel(x, banks):
        nested([ps((128, 512)) for _ in range(banks)])

    assert sim.run(kernel, DUMMY, 8).trace.psum_peak_bytes == 16384
    with pytest.raises(sim.CapacityError, match=r"live PSUM peaks at 18,432 bytes per partition"):
        sim.run(kernel, DUMMY, 9)


def test_capacity_is_per_run():
    # A failed run must not leave its tiles counted against the next one.
    with pytest.raises(sim.CapacityError):
        sim.run(_two_big_tiles, DUMMY)

    def kernel(x):
        nisa.memset(sb((128, 50000)), 0.0)

    assert sim.run(kernel, DUMMY).trace.sbuf_peak_bytes == 200000


# -- explicit addresses ------------------------------------------------------------------------------
def _ring(x):
    """Four row blocks through two SBUF slots each for input and result, placed by hand."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    for i in range(4):
        t = sb((128, 512), address=(0, (i % 2) * 2048))
        nisa.dma_copy(dst=t, src=x[:, i * 512 : (i + 1) * 512])
        u = sb((128, 512), address=(0, 4096 + (i % 2) * 2048))
        nisa.activation(dst=u, op=nl.exp, data=t)
        nisa.dma_copy(dst=out[:, i * 512 : (i + 1) * 512], src=u)
    return out


def test_placed_tiles_run_and_count_while_they_hold_data():
    x = np.random.default_rng(0).random((128, 2048), dtype=np.float32)
    result = sim.run(_ring, x)
    np.testing.assert_allclose(result.outputs, np.exp(x), rtol=1e-6)
    # Eight tiles of 2 KiB each in four slots; in program order only a block's input and result hold
    # data at once (the previous block's result is stored before the next block loads).
    assert result.trace.sbuf_peak_bytes == 2 * 2048


def test_placed_tiles_sharing_bytes_count_them_once():
    def kernel(x):
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        a = sb((128, 512), address=(0, 0))
        nisa.memset(a, 1.0)
        alias = sb((128, 512), address=(0, 0))  # the same 2 KiB, live while a is
        copy = sb((128, 512))
        nisa.tensor_copy(dst=copy, src=alias)
        nisa.dma_copy(dst=out, src=a)
        return out

    assert sim.run(kernel, DUMMY).trace.sbuf_peak_bytes == 2 * 2048  # a and its alias once, plus the copy


def test_placed_tiles_are_traced_at_their_physical_regions_and_the_schedule_orders_their_reuse():
    trace = sim.run(_ring, np.ones((128, 2048), np.float32)).trace
    loads = [i for i in trace if i.op == "dma_copy" and i.writes[0].p1 == 128]
    first, third = loads[0].writes[0], loads[2].writes[0]  # blocks 0 and 2 share slot 0
    assert (first.b0, first.b1) == (0, 2048) and first == third
    second = loads[1].writes[0]
    assert (second.b0, second.b1) == (2048, 4096) and second.buffer_id == first.buffer_id
    # The third load overwrites slot 0, which block 0's activation reads: the scheduler must order them.
    slots = schedule(trace.instructions, cost.hardware("trn2")).slots
    activation0 = next(i for i in trace if i.op == "activation")
    assert slots[loads[2].index].start >= slots[activation0.index].end


def test_a_placed_tile_reading_its_bytes_after_another_tile_overwrote_them_is_an_error():
    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        a = sb((128, 512), address=(0, 0))
        nisa.dma_copy(dst=a, src=x)
        b = sb((128, 256), address=(0, 1024))  # over a's columns 256..511
        nisa.memset(dst=b, value=0.0)
        nisa.dma_copy(dst=out, src=a)
        return out

    with pytest.raises(
        sim.AliasingError,
        match=r"nisa\.dma_copy: src: .* at \(partition 0, byte 0\) reads bytes it wrote that another tile placed "
        r"over it has written since",
    ):
        sim.run(kernel, np.ones((128, 512), np.float32))


def test_reading_bytes_a_placed_tile_never_wrote_is_not_an_aliasing_error():
    """As nki-library's mlp_cte does: a tile read whole where only part was written (the rest is
    garbage the kernel never uses) reads uninitialized values, not an error."""

    def kernel(x):
        out = nl.ndarray((128, 256), x.dtype, buffer=nl.shared_hbm)
        old = sb((128, 512), address=(0, 0))
        nisa.memset(old, 1.0)
        new = sb((128, 512), address=(0, 0))
        nisa.memset(new[:, :256], 2.0)
        whole = sb((128, 512))
        nisa.tensor_copy(dst=whole, src=new)
        nisa.dma_copy(dst=out, src=whole[:, :256])
        return out

    np.testing.assert_array_equal(sim.run(kernel, DUMMY).outputs, 2.0)


@pytest.mark.parametrize(
    "shape, address, limit",
    [((128, 512), (0, 229376 - 1024), "byte 230,400"), ((64, 4), (96, 0), "partition 160")],
)
def test_a_placed_tile_must_lie_inside_the_memory(shape, address, limit):
    def kernel(x):
        sb(shape, address=address)

    with pytest.raises(sim.CapacityError, match=rf"address: .* ends at \(.*{limit}.*\), outside trn2's SBUF"):
        sim.run(kernel, DUMMY)


@pytest.mark.parametrize(
    "buffer, address, problem",
    [
        (nl.shared_hbm, (0, 0), "only SBUF and PSUM tiles take an address"),
        (nl.sbuf, (0,), "must be \\(partition_offset, free_offset\\)"),
        (nl.sbuf, (0, -4), "must be \\(partition_offset, free_offset\\)"),
    ],
)
def test_bad_addresses_are_refused(buffer, address, problem):
    def kernel(x):
        nl.ndarray((128, 4), F32, buffer=buffer, address=address)

    with pytest.raises(sim.NkiValidationError, match=rf"nl\.ndarray: address: {problem}"):
        sim.run(kernel, DUMMY)


def test_the_hardware_rules_see_the_physical_address():
    """A placed tile's partitions and bytes are physical: 32 partitions at partition 16 break the
    start-partition rule, and a matmul result at byte 1024 of PSUM crosses a 2 KiB bank."""

    def misaligned(x):
        nisa.memset(sb((32, 8), address=(16, 0)), 0.0)

    with pytest.raises(sim.NkiValidationError, match=r"start_partition=16"):
        sim.run(misaligned, DUMMY)

    def across_banks(x):
        a = sb((128, 128), BF16)
        nisa.memset(a, 1.0)
        nisa.nc_matmul(dst=ps((128, 512), address=(0, 1024)), stationary=a, moving=sb((128, 512), BF16))

    with pytest.raises(sim.NkiValidationError, match=r"within one 2 KiB PSUM bank \(first_byte=1024"):
        sim.run(across_banks, DUMMY)


@pytest.mark.parametrize("column, clobbered", [(300, True), (100, False)])
def test_aliasing_is_checked_through_tensor_indirection(column, clobbered):
    """An .indirect() view of a placed tile reads the columns its offsets pick: column 300 of ``a`` was
    overwritten by ``b`` placed over a's columns 256..511 (an error), column 100 was not."""

    def kernel(x):
        out = nl.ndarray((16, 16), nl.float32, buffer=nl.shared_hbm)
        a = sb((16, 512), address=(0, 0))
        nisa.memset(a, 1.0)
        b = sb((16, 256), address=(0, 1024))
        nisa.memset(b, 2.0)
        index = nl.ndarray((16, 1), nl.uint16, buffer=nl.sbuf)
        nisa.memset(index, float(column))
        picked = sb((16, 16))
        nisa.tensor_copy(picked, a.indirect(index, num_elem=16), engine=nisa.engine.vector)
        nisa.dma_copy(dst=out, src=picked)
        return out

    if clobbered:
        with pytest.raises(sim.AliasingError, match=r"nisa\.tensor_copy: src: .* reads bytes it wrote"):
            sim.run(kernel, DUMMY, target="trn3")
    else:
        np.testing.assert_array_equal(sim.run(kernel, DUMMY, target="trn3").outputs, 1.0)
