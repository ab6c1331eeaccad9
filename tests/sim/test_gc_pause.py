"""The garbage collector is off while a simulation or a schedule runs, and comes back after."""

import gc
import importlib
import threading

import numpy as np
import pytest

from kernels_neuron import cost, sim
from kernels_neuron.sim.gc_pause import collections_paused

sim.install()
import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

SEEN: list[bool] = []


@nki.jit
def copy_noting_the_collector(x):
    SEEN.append(gc.isenabled())
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def test_a_run_and_a_schedule_pause_the_collector_and_turn_it_back_on():
    assert gc.isenabled()  # else the check below could not tell
    SEEN.clear()
    x = np.ones((4, 8), np.float32)
    result = sim.run(copy_noting_the_collector, x)
    np.testing.assert_array_equal(result.outputs, x)
    assert SEEN == [False]
    assert gc.isenabled()
    scheduling = importlib.import_module("kernels_neuron.cost.schedule")
    with pytest.MonkeyPatch.context() as patch:
        seen_by_the_model = []
        transfer_ns = scheduling.dma_transfer_ns
        patch.setattr(
            scheduling, "dma_transfer_ns", lambda *a: seen_by_the_model.append(gc.isenabled()) or transfer_ns(*a)
        )
        cost.estimate_trace(result.trace)
    assert seen_by_the_model and not any(seen_by_the_model)
    assert gc.isenabled()


def test_nested_and_failing_blocks_turn_the_collector_back_on_once_the_outermost_ends():
    with pytest.raises(RuntimeError):
        with collections_paused():
            with collections_paused():
                pass
            assert not gc.isenabled()  # the inner exit kept the pause
            raise RuntimeError
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off():
    gc.disable()
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_threads_share_one_pause():
    inside, release = threading.Event(), threading.Event()

    def hold():
        with collections_paused():
            inside.set()
            release.wait()

    worker = threading.Thread(target=hold)
    worker.start()
    inside.wait()
    with collections_paused():
        pass
    assert not gc.isenabled()  # the other thread still runs paused
    release.set()
    worker.join()
    assert gc.isenabled()


def _cyclic_garbage(work) -> list:
    """What ``work()`` left that only the cyclic garbage collector could free (objects frozen before the
    call, see below, are left out)."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        work()
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@nki.jit
def copy_program_rows(x):
    rows = x.shape[0] // 2
    tile = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x[nl.program_id(0) * rows : (nl.program_id(0) + 1) * rows])
    out = nl.ndarray((rows, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def test_finished_runs_leave_no_reference_cycles():
    """A run's trace (about ten objects per instruction) is freed with the last reference to it: with the
    collector paused while runs are made, a cycle would keep a finished run's trace in memory until the
    collector next runs, and have it traverse the trace."""

    def a_cycle():
        node: list = []
        node.append(node)

    x = np.ones((8, 4), np.float32)
    gc.collect()
    gc.freeze()  # the process's objects so far stay out of the collections below, which then take milliseconds
    try:
        assert _cyclic_garbage(a_cycle)  # the check sees a cycle
        assert not _cyclic_garbage(lambda: cost.estimate_trace(sim.run(copy_noting_the_collector, x).trace))
        assert not _cyclic_garbage(lambda: sim.run(copy_program_rows, x, grid=2))
        assert not _cyclic_garbage(lambda: sim.run_ranks(copy_program_rows, [(x,), (x,)], grid=2))
    finally:
        gc.unfreeze()
