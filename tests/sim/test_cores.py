"""The LNC=2 cross-core instructions ``nisa.sendrecv`` and ``nisa.core_barrier``, on a grid of two
programs (one per core), against their API reference: the ring-exchange example, barriers between
writers of a shared HBM tensor, and the rules."""

from __future__ import annotations

import numpy as np
import pytest

from kernels_neuron import sim

sim.install()

import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402


def _tile(x):
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    return tile


def test_sendrecv_ring_exchange_of_the_api_reference():
    """Each core sends its tile to the next rank and receives the previous rank's."""
    data = np.arange(2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8)

    def kernel(x):
        out = nl.ndarray((2, 4, 8), nl.float32, buffer=nl.shared_hbm)
        current_rank = nl.program_id(0)
        next_rank, prev_rank = (current_rank + 1) % 2, (current_rank - 1) % 2
        send_data = _tile(x[current_rank])
        recv_buffer = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.sendrecv(src=send_data, dst=recv_buffer, send_to_rank=next_rank, recv_from_rank=prev_rank, pipe_id=0)
        nisa.dma_copy(dst=out[current_rank], src=recv_buffer)
        return out

    result = sim.run(kernel, data, grid=2, target="trn2")
    np.testing.assert_array_equal(result.outputs, data[::-1])
    sends = [i for i in result.trace if i.op == "sendrecv"]
    assert sorted(i.program for i in sends) == [(0,), (1,)] and sends[0].bytes_moved == 4 * 8 * 4


def test_sendrecv_pipes_pair_up_in_order_and_separately():
    def kernel():
        rank = nl.program_id(0)
        received = []
        for pipe, step in ((7, 0), (3, 1), (7, 2)):
            mine = nl.full((1, 2), 10 * rank + step, nl.float32)
            got = nl.ndarray((1, 2), nl.float32, buffer=nl.sbuf)
            nisa.sendrecv(src=mine, dst=got, send_to_rank=1 - rank, recv_from_rank=1 - rank, pipe_id=pipe)
            received.append(got)
        out = nl.ndarray((2, 3, 2), nl.float32, buffer=nl.shared_hbm)
        for step, got in enumerate(received):
            nisa.dma_copy(dst=out[rank, step : step + 1, :], src=got)
        return out

    out = sim.run(kernel, grid=2).outputs
    np.testing.assert_array_equal(out[0, :, 0], [10, 11, 12])
    np.testing.assert_array_equal(out[1, :, 0], [0, 1, 2])


def test_core_barrier_lets_each_core_read_what_the_other_wrote():
    def kernel(x):
        rank = nl.program_id(0)
        shared = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=shared[rank : rank + 1, :], src=_tile(x[rank : rank + 1, :]))
        nisa.core_barrier(data=shared, cores=(0, 1))
        whole = _tile(shared)  # both halves are written by now
        out = nl.ndarray((2, 2, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[rank], src=whole)
        return out

    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    result = sim.run(kernel, x, grid=2)
    np.testing.assert_array_equal(result.outputs, np.stack([x, x]))
    # Core 0 waited at the barrier until core 1 got there: core 1 passed it first.
    order = [(i.program[0], i.op) for i in result.trace]
    assert order.index((1, "core_barrier")) < order.index((0, "core_barrier"))


def test_a_sendrecv_without_its_peer_is_reported_as_a_deadlock():
    def kernel():
        rank = nl.program_id(0)
        if rank == 0:
            tile = nl.zeros((1, 4), nl.float32)
            nisa.sendrecv(src=tile, dst=tile, send_to_rank=1, recv_from_rank=1, pipe_id=5)

    with pytest.raises(nisa.NkiValidationError, match=r"deadlock: programs \[0\] wait at nisa\.sendrecv\(pipe_id=5\)"):
        sim.run(kernel, grid=2)


def test_an_error_in_one_core_surfaces_while_the_other_waits():
    def kernel():
        rank = nl.program_id(0)
        tile = nl.zeros((1, 4), nl.float32)
        if rank == 0:
            nisa.sendrecv(src=tile, dst=tile, send_to_rank=1, recv_from_rank=1, pipe_id=0)
        else:
            raise ValueError("core 1 failed")

    with pytest.raises(ValueError, match="core 1 failed"):
        sim.run(kernel, grid=2)


@pytest.mark.parametrize(
    "problem, grid, target, pattern",
    [
        ("ok", 2, "trn1", r"nisa\.sendrecv: target: needs NeuronCore-v3 or newer \(target=trn1\)"),
        ("ok", 1, "trn2", r"nisa\.sendrecv: launch: needs an LNC=2 launch.*\(grid=\[1\]\)"),
        ("rank", 2, "trn2", r"nisa\.sendrecv: send_to_rank: must be 0 or 1 .*\(value=2\)"),
        ("psum", 2, "trn2", r"nisa\.sendrecv: src: must be in SBUF, not PSUM"),
        ("gpsimd size", 2, "trn2", r"gpsimd_dma moves at most .*\(bytes_per_partition=2048, limit=1024\)"),
    ],
)
def test_sendrecv_rules(problem, grid, target, pattern):
    def kernel():
        width = 512 if problem == "gpsimd size" else 4
        src = nl.ndarray((1, width), nl.float32, buffer=nl.psum if problem == "psum" else nl.sbuf)
        nisa.sendrecv(
            src=src,
            dst=nl.ndarray((1, width), nl.float32, buffer=nl.sbuf),
            send_to_rank=2 if problem == "rank" else 0,
            recv_from_rank=0,
            pipe_id=0,
            dma_engine=nisa.dma_engine.gpsimd_dma if problem == "gpsimd size" else nisa.dma_engine.dma,
        )

    with pytest.raises(nisa.NkiValidationError, match=pattern):
        sim.run(kernel, grid=grid, target=target)


def test_core_barrier_rules():
    def kernel(problem):
        data = nl.ndarray((2, 8), nl.float32, buffer=nl.hbm if problem == "private" else nl.shared_hbm)
        nisa.core_barrier(data=data, cores=(0, 2) if problem == "cores" else (0, 1))

    with pytest.raises(nisa.NkiValidationError, match=r"core_barrier: cores: only \(0, 1\) is supported"):
        sim.run(kernel, "cores", grid=2)
    with pytest.raises(nisa.NkiValidationError, match=r"core_barrier: launch: needs an LNC=2 launch"):
        sim.run(kernel, "both cores", grid=1)
    with pytest.raises(nisa.NkiValidationError, match=r"core_barrier: data: must be a shared HBM tensor.*buffer=hbm"):
        sim.run(kernel, "private", grid=2)


def test_programs_without_cross_core_instructions_still_run_in_order():
    def kernel():
        tile = nl.zeros((1, 4), nl.float32)
        nisa.memset(dst=tile, value=float(nl.program_id(0)))

    trace = sim.run(kernel, grid=3).trace
    assert [i.program[0] for i in trace] == [0, 0, 1, 1, 2, 2]


def test_a_one_core_barrier_passes_as_nki_library_uses_it():
    """nki-library's blockwise MoE kernel calls core_barrier(output, (0,)) when it runs on one core."""

    def kernel():
        data = nl.ndarray((2, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.core_barrier(data, (0,))

    assert [i.op for i in sim.run(kernel).trace] == ["core_barrier"]
    with pytest.raises(nisa.NkiValidationError, match=r"core_barrier: target: needs NeuronCore-v3"):
        sim.run(kernel, target="trn1")
