"""Running benchmark cases: simulate + model every case; on a Trainium host, also time it.

The cost model needs only the instruction trace, so cases are simulated trace-only
(``sim.run(..., numerics=False)``: every instruction checked and recorded, the engines' arithmetic
skipped). ``check_numerics`` also simulates each case in full and checks that both runs leave the
same trace, instruction by instruction."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import partial
from typing import Any

import numpy as np

from .. import cost, sim
from ..sim.dtypes import numpy_to_torch
from ..sim.gc_pause import collections_paused
from ..sim.trace import Trace
from .case import CHECKED, TRACE_ONLY, Case, Record

NEURON_DEVICE = "neuron"

DEVICE_WARMUP = 3
DEVICE_ITERATIONS = 20


def device_available() -> bool:
    """True on a Trainium host with TorchNeuron (``torch.neuron``) and a device to run on."""
    neuron = _torch_neuron()
    if neuron is None:
        return False
    is_available = getattr(neuron, "is_available", None)
    return bool(is_available()) if callable(is_available) else True


def _torch_neuron() -> Any:
    """TorchNeuron's ``torch.neuron`` module, or None (no torch, or torch without TorchNeuron)."""
    try:
        import torch
    except ImportError:
        return None
    return getattr(torch, "neuron", None)


def _synchronize() -> None:
    _torch_neuron().synchronize()


def _time_on_device(fn: Callable[[], object]) -> float:
    """Mean µs per call after warm-up, synchronising the device around the timed loop."""
    for _ in range(DEVICE_WARMUP):
        fn()
    _synchronize()
    start = time.perf_counter()
    for _ in range(DEVICE_ITERATIONS):
        fn()
    _synchronize()
    return (time.perf_counter() - start) / DEVICE_ITERATIONS * 1e6


def torch_inputs(inputs: tuple, device: str) -> tuple:
    """The case's NumPy inputs as torch tensors on ``device`` (bf16 through its bits, which
    ``torch.as_tensor`` cannot read); other arguments unchanged."""
    return tuple(numpy_to_torch(x).to(device) if isinstance(x, np.ndarray) else x for x in inputs)


def device_calls(case: Case, inputs: tuple, device: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The two calls a device timing loop repeats, on ``device``: the kernel (through NKI's torch
    interface) and the PyTorch computation it replaces. On the CPU the kernel runs on the simulator,
    which is how the tests check both calls without a Trainium host."""
    args = torch_inputs(inputs, device)
    kernel = case.kernel[case.grid] if case.grid is not None else case.kernel
    return partial(kernel, *args, **case.kwargs), case.prepare_reference(*args, **case.kwargs)


def _measure(case: Case, inputs: tuple) -> tuple[float, float]:
    kernel, reference = device_calls(case, inputs, NEURON_DEVICE)
    return _time_on_device(kernel), _time_on_device(reference)


class TraceMismatch(AssertionError):
    """A full simulation of a case left a different trace than its trace-only run."""


def trace_difference(trace_only: Trace, full: Trace) -> str | None:
    """Where two traces of one kernel differ (the first differing instruction, the instruction
    count or the peak on-chip memory), or None when they are identical."""
    for index, (a, b) in enumerate(zip(trace_only.instructions, full.instructions)):
        if a != b:
            return f"instruction {index} differs: trace-only {a} against full {b}"
    if len(trace_only) != len(full):
        return f"instruction count: trace-only {len(trace_only)} against full {len(full)}"
    for what in ("sbuf_peak_bytes", "psum_peak_bytes"):
        a, b = getattr(trace_only, what), getattr(full, what)
        if a != b:
            return f"{what}: trace-only {a} against full {b}"
    return None


def simulate(case: Case, inputs: tuple, target: str, numerics: bool) -> tuple[sim.SimResult, float]:
    """One simulation of the case and its wall time in seconds."""
    start = time.perf_counter()
    result = sim.run(case.kernel, *inputs, target=target, grid=case.grid, numerics=numerics, **case.kwargs)
    return result, time.perf_counter() - start


def run_case(
    case: Case, target: str = "trn2", seed: int = 0, on_device: bool | None = None, check_numerics: bool = False
) -> Record:
    """Simulate the case trace-only, model it on ``target``, and time it on a device when one is present.

    ``check_numerics`` also simulates it in full first (the engines' arithmetic, as a kernel call
    does) and raises :class:`TraceMismatch` unless the trace-only run left the same trace; the
    record's ``sim_wall_s`` then counts both simulations. A trace-only run alone takes the case's
    stand-in inputs (``Case.make_inputs(seed, values=False)``)."""
    on_device = device_available() if on_device is None else on_device
    inputs = case.make_inputs(seed, values=check_numerics or on_device)
    report, wall = _simulated_and_modelled(case, inputs, target, check_numerics)
    record = Record(
        name=case.name,
        kernel=getattr(case.kernel, "__name__", str(case.kernel)),
        model=case.model,
        shape=dict(case.shape),
        dtype=case.dtype,
        target=report.target,
        reference=case.reference_name,
        modelled_us=report.time_us,
        roofline_us=report.roofline_us,
        bound=report.bound,
        pct_of_roofline=report.pct_of_roofline,
        flops=report.flops,
        tflops=report.tflops,
        pct_tensor_peak=report.pct_tensor_peak,
        hbm_bytes=report.hbm_bytes,
        hbm_gbps=report.hbm_gbps,
        pct_hbm_peak=report.pct_hbm_peak,
        sim_wall_s=wall,
        instructions=report.instructions,
        simulation=CHECKED if check_numerics else TRACE_ONLY,
    )
    if on_device:
        record.measured_us, record.reference_measured_us = _measure(case, inputs)
    return record


@collections_paused()
def _simulated_and_modelled(
    case: Case, inputs: tuple, target: str, check_numerics: bool
) -> tuple[cost.CostReport, float]:
    """``run_case``'s simulations and model, and their simulation wall time. The traces are made, modelled
    and dropped under one pause of the garbage collector, which so never traverses them (see
    ``sim/gc_pause.py``)."""
    wall = 0.0
    if check_numerics:
        full, wall = simulate(case, inputs, target, numerics=True)
    result, trace_only_wall = simulate(case, inputs, target, numerics=False)
    wall += trace_only_wall
    if check_numerics:
        difference = trace_difference(result.trace, full.trace)
        if difference is not None:
            raise TraceMismatch(f"{case.name}: {difference}")
    return cost.estimate_trace(result.trace, target, flops=case.standard_flops), wall


# Each worker holds torch and one case's trace (about 1.5 GB at most, for the largest MoE case).
MAX_DEFAULT_JOBS = 8


def default_jobs() -> int:
    """Worker processes ``kernels-neuron bench`` starts unless told: one per CPU this process may run on
    (its affinity where the OS tells it), at most MAX_DEFAULT_JOBS."""
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    return min(cpus, MAX_DEFAULT_JOBS)


def run_suite(
    cases: Iterable[Case],
    target: str = "trn2",
    name_filter: str | None = None,
    progress: bool = True,
    check_numerics: bool = False,
    jobs: int = 1,
) -> list[Record]:
    """Run every case whose name contains ``name_filter``, with a progress bar (``check_numerics``:
    see :func:`run_case`). ``jobs`` > 1 simulates that many cases at once in worker processes (the
    cases must pickle: module-level kernels and functions); the records come back in the cases' order.
    Where a device is present the cases run one at a time, so that no timing shares the host."""
    chosen = [c for c in cases if name_filter is None or name_filter.lower() in c.name.lower()]
    if not chosen:
        raise NoMatchingCase(f"no benchmark case matches filter {name_filter!r}")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    run = partial(run_case, target=target, check_numerics=check_numerics)
    jobs = 1 if device_available() else min(jobs, len(chosen))
    with contextlib.ExitStack() as stack:
        if jobs == 1:
            advance = _progress_bar(stack, len(chosen)) if progress else None
            records = []
            for case in chosen:
                if advance is not None:
                    advance(case.name, done=False)
                with _naming(case):
                    records.append(run(case))
                if advance is not None:
                    advance(case.name, done=True)
            return records
        for case in chosen:  # before any work: the pool would only fail when it reaches the case
            try:
                pickle.dumps(case)
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise ValueError(
                    f"case {case.name!r} cannot be sent to a worker process ({exc}); run it with jobs=1 "
                    "(--jobs 1), or build it from module-level kernels and functions"
                ) from exc
        pool = stack.enter_context(ProcessPoolExecutor(jobs, mp_context=_worker_context(), initializer=_start_worker))
        # The first submit starts the workers: before the progress bar's refresh thread exists, so that a
        # forked worker cannot inherit a lock that thread held.
        futures = {pool.submit(run, case): index for index, case in enumerate(chosen)}
        advance = _progress_bar(stack, len(chosen)) if progress else None
        by_index: dict[int, Record] = {}
        for future in as_completed(futures):
            index = futures[future]
            try:
                with _naming(chosen[index]):
                    by_index[index] = future.result()
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)  # the queued cases would run to no purpose
                raise
            if advance is not None:
                advance(chosen[index].name, done=True)
        return [by_index[i] for i in range(len(chosen))]


def _worker_context() -> multiprocessing.context.BaseContext:
    """How worker processes start: forked on Linux, so that they inherit the imported simulator, kernels
    and torch (a spawned worker spends about 2 s of CPU importing them again); spawned elsewhere, where
    forking a process that has loaded system frameworks is unsafe (Python's own default on macOS)."""
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _start_worker() -> None:
    """A worker's set-up: the simulator installed (a spawned worker starts without it), and torch kept to
    one thread. Workers already run one per core, and a forked child must not enter a thread pool its
    parent may have started (the child has none of the parent's threads)."""
    import torch

    sim.install()
    torch.set_num_threads(1)


class NoMatchingCase(ValueError):
    """``run_suite``'s name filter matched no case."""


@contextlib.contextmanager
def _naming(case: Case) -> Iterator[None]:
    """An exception raised for ``case`` says which case it came from (the progress bar is gone by then)."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"while running bench case {case.name!r}")
        raise


def _progress_bar(stack: contextlib.ExitStack, total: int) -> Callable[..., None]:
    """A rich progress bar over ``total`` cases, closed with ``stack``; returns its update call."""
    from rich.progress import Progress

    bar = stack.enter_context(Progress(transient=True))
    task = bar.add_task("simulating + modelling", total=total)

    def advance(name: str, done: bool) -> None:
        bar.update(task, description=name, advance=1 if done else 0)

    return advance
