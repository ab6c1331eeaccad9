"""Trace-only runs (``sim.run(..., numerics=False)``): the same checks and the same trace as a full
simulation, no arithmetic, and no value that could pass for a result."""

import numpy as np
import pytest

from kernels_neuron import sim

sim.install()
import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402


@nki.jit
def scaled_copy(x):
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=2.0)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


@nki.jit
def loop_count_from(counts, scale_first):
    """As many tensor_scalar instructions as ``counts[0, 0]`` says (read into a register), the count
    scaled by an instruction first when ``scale_first``."""
    info = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=info, src=counts)
    if scale_first:
        nisa.tensor_scalar(dst=info, data=info, op0=nl.add, operand0=1)
    trips = nisa.register_alloc()
    nisa.register_load(trips, info)
    work = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=work, value=1.0)
    for _ in nl.dynamic_range(trips):
        nisa.tensor_scalar(dst=work, data=work, op0=nl.multiply, operand0=3.0)
    return None


@nki.jit
def in_place(x, y):
    """Writes y's computed double into x and x's values into y's first row, by DMA."""
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=y)
    nisa.dma_copy(dst=y[0:1, :], src=x[0:1, :])
    nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=x, src=tile)
    return None


def test_trace_only_records_the_same_trace_and_returns_no_outputs():
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    full, trace_only = sim.run(scaled_copy, x), sim.run(scaled_copy, x, numerics=False)
    assert full.numerics and np.array_equal(full.outputs, 2 * x)
    assert not trace_only.numerics and trace_only.outputs is None
    assert trace_only.trace.instructions == full.trace.instructions
    assert trace_only.trace.sbuf_peak_bytes == full.trace.sbuf_peak_bytes


def test_values_moved_from_the_inputs_reach_registers_and_loop_bounds():
    for trips in (2, 5):
        counts = np.full((1, 1), trips, dtype=np.int32)
        trace_only = sim.run(loop_count_from, counts, False, numerics=False).trace
        assert trace_only.instructions == sim.run(loop_count_from, counts, False).trace.instructions
        assert trace_only.counts()[("vector", "tensor_scalar")] == trips


def test_a_value_an_instruction_computed_cannot_steer_a_trace_only_run():
    counts = np.full((1, 1), 2, dtype=np.int32)
    assert sim.run(loop_count_from, counts, True).trace.counts()[("vector", "tensor_scalar")] == 1 + 3
    with pytest.raises(sim.UncomputedValueError, match="nisa.register_load: src: .*numerics=True"):
        sim.run(loop_count_from, counts, True, numerics=False)


def test_uncomputed_values_spread_through_instructions_that_still_compute():
    """tensor_copy_predicated still runs its arithmetic in a trace-only run; what it writes from an
    uncomputed operand is uncomputed too."""

    @nki.jit
    def kernel(counts):
        info = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=info, src=counts)
        doubled = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=doubled, data=info, op0=nl.multiply, operand0=2)
        chosen = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=chosen, value=0)
        mask = nl.ndarray((1, 1), nl.uint8, buffer=nl.sbuf)
        nisa.memset(dst=mask, value=1)
        nisa.tensor_copy_predicated(dst=chosen, src=doubled, predicate=mask)
        register = nisa.register_alloc()
        nisa.register_load(register, chosen)
        return None

    counts = np.full((1, 1), 3, dtype=np.int32)
    sim.run(kernel, counts)
    with pytest.raises(sim.UncomputedValueError, match="register_load"):
        sim.run(kernel, counts, numerics=False)


def test_arguments_written_with_uncomputed_values_read_as_never_written_memory():
    x = np.ones((4, 8), np.float32)
    y = np.arange(32, dtype=np.float32).reshape(4, 8)
    expected_y = np.concatenate([np.ones((1, 8), np.float32), y[1:]])
    sim.run(in_place, x, y)
    assert np.array_equal(x, 2 * np.arange(32, dtype=np.float32).reshape(4, 8)) and np.array_equal(y, expected_y)
    x, y = np.ones((4, 8), np.float32), np.arange(32, dtype=np.float32).reshape(4, 8)
    sim.run(in_place, x, y, numerics=False)
    assert np.isnan(x).all()  # computed by tensor_scalar: not computed here, and not left looking like data
    assert np.array_equal(y, expected_y)  # moved by DMA from an input: exact


def test_trace_only_runs_check_every_operand_as_a_full_run_does():
    @nki.jit
    def bad_matmul(a):
        stationary = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        moving = nl.ndarray((64, 512), nl.bfloat16, buffer=nl.sbuf)
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=out, stationary=stationary, moving=moving)
        return None

    for numerics in (True, False):
        with pytest.raises(sim.NkiValidationError, match="contraction .partition. dims differ"):
            sim.run(bad_matmul, np.zeros((1, 1), np.float32), numerics=numerics)


def test_psum_accumulation_is_tracked_without_values():
    """Whether a matmul accumulates (and so reads its PSUM tile) comes from which instructions wrote
    the tile, not from values: a trace-only run records the same dst_in reads."""

    @nki.jit
    def accumulate(a):
        tile = nl.ndarray((128, 128), nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=a)
        out = nl.ndarray((128, 128), nl.float32, buffer=nl.psum)
        for _ in range(3):
            nisa.nc_matmul(dst=out, stationary=tile, moving=tile)
        return None

    a = np.ones((128, 128), np.float32).astype(nl.bfloat16)
    full, trace_only = sim.run(accumulate, a), sim.run(accumulate, a, numerics=False)
    roles = [[op.role for op in i.operands] for i in trace_only.trace if i.op == "nc_matmul"]
    assert roles == [["dst", "stationary", "moving"]] + [["dst", "stationary", "moving", "dst_in"]] * 2
    assert trace_only.trace.instructions == full.trace.instructions


def test_a_gather_through_computed_indices_is_traced_without_them():
    """Indices a trace-only run did not compute (here, an iota) decide only which rows move, not the
    trace (an indirect access is recorded as touching its whole allocation): the gather is traced, and
    its destination is uncomputed."""

    @nki.jit
    def kernel(data):
        index_f = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.iota(dst=index_f, pattern=[[0, 1]], offset=0, channel_multiplier=2)
        index = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=index, src=index_f, engine=nisa.engine.gpsimd)
        rows = nl.ndarray((4, 8), data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=data.ap(pattern=[[8, 4], [1, 8]], vector_offset=index, indirect_dim=0))
        out = nl.ndarray((4, 8), data.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=rows)
        return out

    data = np.arange(64, dtype=np.float32).reshape(8, 8)
    full = sim.run(kernel, data)
    np.testing.assert_array_equal(full.outputs, data[[0, 2, 4, 6]])
    traced = sim.run(kernel, data, numerics=False)
    assert traced.outputs is None
    assert [(i.op, i.attrs) for i in traced.trace.instructions] == [(i.op, i.attrs) for i in full.trace.instructions]
