"""Full garbage collections are put off while a simulation or a schedule runs, and come back after."""

import gc
import threading

import numpy as np
import pytest

from kernels_neuron import cost, sim
from kernels_neuron.sim.gc_pause import PAUSED_FULL_COLLECTION_INTERVAL, collections_paused, full_collections_paused

sim.install()
import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

SEEN: list[tuple[int, ...]] = []


@nki.jit
def copy_noting_the_threshold(x):
    SEEN.append(gc.get_threshold())
    tile = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


def test_a_run_pauses_full_collections_and_restores_the_thresholds():
    before = gc.get_threshold()
    assert before[2] < PAUSED_FULL_COLLECTION_INTERVAL  # else the check below could not tell
    SEEN.clear()
    x = np.ones((4, 8), np.float32)
    result = sim.run(copy_noting_the_threshold, x)
    np.testing.assert_array_equal(result.outputs, x)
    assert SEEN == [(*before[:2], PAUSED_FULL_COLLECTION_INTERVAL)]
    assert gc.get_threshold() == before
    cost.estimate_trace(result.trace)
    assert gc.get_threshold() == before


def test_nested_and_failing_blocks_restore_the_thresholds_once_the_outermost_ends():
    before = gc.get_threshold()
    with pytest.raises(RuntimeError):
        with full_collections_paused():
            with full_collections_paused():
                pass
            assert gc.get_threshold()[2] == PAUSED_FULL_COLLECTION_INTERVAL  # the inner exit kept the pause
            raise RuntimeError
    assert gc.get_threshold() == before


def test_threads_share_one_pause():
    before = gc.get_threshold()
    inside, release = threading.Event(), threading.Event()

    def hold():
        with full_collections_paused():
            inside.set()
            release.wait()

    worker = threading.Thread(target=hold)
    worker.start()
    inside.wait()
    with full_collections_paused():
        pass
    assert gc.get_threshold()[2] == PAUSED_FULL_COLLECTION_INTERVAL  # the other thread still runs paused
    release.set()
    worker.join()
    assert gc.get_threshold() == before


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
    """A run's trace (about ten objects per instruction) is freed with the last reference to it: with
    full collections paused, a cycle would keep every finished run's trace in memory until one."""

    def a_cycle():
        node: list = []
        node.append(node)

    x = np.ones((8, 4), np.float32)
    gc.collect()
    gc.freeze()  # the process's objects so far stay out of the collections below, which then take milliseconds
    try:
        assert _cyclic_garbage(a_cycle)  # the check sees a cycle
        assert not _cyclic_garbage(lambda: cost.estimate_trace(sim.run(copy_noting_the_threshold, x).trace))
        assert not _cyclic_garbage(lambda: sim.run(copy_program_rows, x, grid=2))
        assert not _cyclic_garbage(lambda: sim.run_ranks(copy_program_rows, [(x,), (x,)], grid=2))
    finally:
        gc.unfreeze()


def test_collections_paused_turns_the_collector_off_and_back_on_once_the_outermost_ends():
    assert gc.isenabled()  # else the checks below could not tell
    with pytest.raises(RuntimeError):
        with collections_paused():
            with collections_paused(), full_collections_paused():
                pass
            assert not gc.isenabled()  # the inner exits kept it off
            raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()  # a collector off before stays off
    finally:
        gc.enable()


def test_the_bench_models_a_case_with_the_collector_off(monkeypatch):
    from kernels_neuron.bench import runner, suite

    seen = []
    estimate_trace = cost.estimate_trace
    monkeypatch.setattr(cost, "estimate_trace", lambda *a, **k: seen.append(gc.isenabled()) or estimate_trace(*a, **k))
    case = suite.rmsnorm_case("rmsnorm-fwd/small", "llama", 8, 128, "llama")
    runner.run_case(case, on_device=False)
    assert seen == [False]
    assert gc.isenabled()
