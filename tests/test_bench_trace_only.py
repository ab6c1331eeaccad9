"""The bench simulates trace-only (``sim.run(..., numerics=False)``): for every suite case, at the
reduced sizes ``test_bench_references`` builds them (one per variant of each case, a test there checks
that every suite case is covered), the trace-only run leaves the same trace, instruction by
instruction, as a full simulation, and so the same modelled figures."""

import dataclasses
import json
import pickle
from concurrent.futures import ProcessPoolExecutor
from functools import partial

import numpy as np
import pytest
from test_bench_references import SMALL

from kernels_neuron import bench, compiled_sim, cost, sim
from kernels_neuron.bench import suite as bench_suite
from kernels_neuron.bench.calibration import fully_optimized
from kernels_neuron.cli import main

# fully_optimized's smallest shape is one 2048x1024x1024 block: seconds of arithmetic in full.
CASES = [pytest.param(c, marks=pytest.mark.slow) if c.kernel is fully_optimized else c for c in SMALL]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_trace_only_leaves_the_full_simulations_trace_and_modelled_figures(case):
    """The bench's trace-only run, on the stand-in inputs it takes, against a full run on real values."""
    full = sim.run(case.kernel, *case.make_inputs(0), grid=case.grid, **case.kwargs)
    stand_ins = case.make_inputs(0, values=False)
    trace_only = sim.run(case.kernel, *stand_ins, grid=case.grid, numerics=False, **case.kwargs)
    assert full.numerics and not trace_only.numerics and trace_only.outputs is None
    assert len(trace_only.trace) > 0
    assert bench.trace_difference(trace_only.trace, full.trace) is None
    assert cost.estimate_trace(trace_only.trace, "trn2", flops=case.standard_flops) == cost.estimate_trace(
        full.trace, "trn2", flops=case.standard_flops
    )


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_stand_in_inputs_keep_shapes_dtypes_and_what_the_trace_depends_on(case):
    """``values=False`` zeros the drawn floating-point data (the largest input among them): a block
    table, an MoE routing (its weights too), the scalars are the ones the real inputs carry."""
    real, stand_ins = case.make_inputs(0), case.make_inputs(0, values=False)
    assert len(real) == len(stand_ins)
    zeroed = []
    for a, b in zip(real, stand_ins):
        if not isinstance(a, np.ndarray):
            assert a == b
            continue
        assert a.shape == b.shape and a.dtype == b.dtype
        if not np.array_equal(a, b):
            assert a.dtype.kind not in "iub" and not np.any(b.astype(np.float32)), "only drawn data may differ"
            zeroed.append(a.size)
    assert zeroed and max(zeroed) == max(a.size for a in real if isinstance(a, np.ndarray))


def test_kernels_pickle_by_reference_for_worker_processes():
    case = _small("mlp-fwd/silu")
    for kernel in (case.kernel, case.kernel[2]):
        copy = pickle.loads(pickle.dumps(kernel))
        assert copy.func is kernel.func and copy.grid == kernel.grid and copy.options == kernel.options

    @sim.jit
    def local_kernel(x):
        return x

    with pytest.raises(pickle.PicklingError, match="local_kernel"):
        pickle.dumps(local_kernel)


def test_parallel_suite_runs_give_the_serial_records_in_order(monkeypatch):
    from kernels_neuron.bench import runner

    monkeypatch.setattr(runner, "device_available", lambda: False)  # else it would run them one at a time
    cases = [_small("rmsnorm-fwd/llama"), _small("attention-fwd/causal"), _small("mlp-fwd/silu")]
    serial = bench.run_suite(cases, progress=False)
    parallel = bench.run_suite(cases, progress=False, jobs=2)
    failing = dataclasses.replace(
        cases[0], name="rmsnorm-fwd/no-rows", make_inputs=partial(cases[0].make_inputs.func, -1, 96, False)
    )
    for jobs in (1, 2):
        with pytest.raises(ValueError, match="negative dimensions") as failure:
            bench.run_suite([cases[1], failing], progress=False, jobs=jobs)
        assert "while running bench case 'rmsnorm-fwd/no-rows'" in failure.value.__notes__

    def modelled(records):
        return [{k: v for k, v in r.as_dict().items() if k != "sim_wall_s"} for r in records]

    assert [r.name for r in parallel] == [c.name for c in cases]
    assert modelled(parallel) == modelled(serial)
    with pytest.raises(ValueError, match="jobs must be at least 1"):
        bench.run_suite(cases, jobs=0)
    unpicklable = dataclasses.replace(cases[0], prepare_reference=lambda *args: None)
    with pytest.raises(ValueError, match="'rmsnorm-fwd/llama' cannot be sent to a worker process"):
        bench.run_suite([unpicklable, cases[1]], progress=False, jobs=2)


def test_a_parallel_suite_run_forks_its_workers_before_its_progress_bar_starts(monkeypatch):
    """The progress bar's refresh thread must not exist when the workers fork (a child would inherit any
    lock it held), and here the workers are forked, not spawned."""
    import multiprocessing.context

    from kernels_neuron.bench import runner

    workers_at_bar_start = []
    before = {p.pid for p in multiprocessing.active_children()}

    def progress_bar(stack, total):
        workers_at_bar_start.extend(
            p for p in multiprocessing.active_children() if p.is_alive() and p.pid not in before
        )
        return lambda name, done: None

    monkeypatch.setattr(runner, "device_available", lambda: False)
    monkeypatch.setattr(runner, "_progress_bar", progress_bar)
    cases = [_small("rmsnorm-fwd/llama"), _small("mlp-fwd/silu")]
    bench.run_suite(cases, progress=True, jobs=2)
    assert len(workers_at_bar_start) == 2
    assert all(isinstance(p, multiprocessing.context.ForkProcess) for p in workers_at_bar_start)


def test_bench_workers_are_forked_on_linux_only_and_run_torch_on_one_thread(monkeypatch):
    import torch

    from kernels_neuron.bench import runner

    assert runner._worker_context().get_start_method() == "fork"  # Linux: no second import of torch
    parent_threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a forked child would inherit it
    try:
        with ProcessPoolExecutor(1, mp_context=runner._worker_context(), initializer=runner._start_worker) as pool:
            assert pool.submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(parent_threads)
    monkeypatch.setattr(runner.sys, "platform", "darwin")  # where forking after system frameworks is unsafe
    assert runner._worker_context().get_start_method() == "spawn"


def test_every_suite_case_can_go_to_a_worker_process():
    for case in bench_suite.CASES:
        copy = pickle.loads(pickle.dumps(case))
        assert copy.name == case.name and copy.kernel.func is case.kernel.func


def _small(name):
    return next(c for c in SMALL if c.name == name)


def test_trace_difference_names_the_first_differing_instruction():
    case = _small("rmsnorm-fwd/llama")
    trace = sim.run(case.kernel, *case.make_inputs(0), numerics=False, **case.kwargs).trace
    changed = dataclasses.replace(trace, instructions=list(trace.instructions))
    changed.instructions[3] = dataclasses.replace(changed.instructions[3], free_elements=1)
    assert bench.trace_difference(changed, trace).startswith("instruction 3 differs")
    shorter = dataclasses.replace(trace, instructions=trace.instructions[:-1])
    assert "instruction count" in bench.trace_difference(shorter, trace)
    assert "sbuf_peak_bytes" in bench.trace_difference(dataclasses.replace(trace, sbuf_peak_bytes=1), trace)


def test_run_case_is_trace_only_unless_asked_to_check_numerics(monkeypatch):
    case = _small("mlp-fwd/silu")
    trace_only = bench.run_case(case)
    checked = bench.run_case(case, check_numerics=True)
    assert trace_only.simulation == "trace-only" and "checked against a full simulation" in checked.simulation
    modelled = {k: v for k, v in trace_only.as_dict().items() if k not in ("sim_wall_s", "simulation")}
    assert modelled == {k: v for k, v in checked.as_dict().items() if k not in ("sim_wall_s", "simulation")}

    real_run = sim.run

    def drifting(*args, numerics=True, **kwargs):  # a trace-only mode that dropped an instruction
        result = real_run(*args, numerics=numerics, **kwargs)
        if not numerics:
            result.trace.instructions.pop()
        return result

    monkeypatch.setattr(sim, "run", drifting)
    with pytest.raises(bench.TraceMismatch, match="mlp-fwd/silu: instruction count"):
        bench.run_case(case, check_numerics=True)


@pytest.mark.parametrize("jobs", ["0", "-1"])
def test_cli_refuses_fewer_than_one_job(jobs, capsys):
    with pytest.raises(SystemExit) as refused:
        main(["bench", "--filter", "decode128", "--jobs", jobs])
    assert refused.value.code == 2 and "--jobs: must be at least 1" in capsys.readouterr().err


def test_cli_says_which_simulation_ran(tmp_path, capsys):
    out_json = tmp_path / "b.json"
    assert main(["bench", "--filter", "decode128", "--check-numerics", "--json", str(out_json)]) == 0
    assert "traces are identical" in capsys.readouterr().out
    (record,) = json.loads(out_json.read_text())["records"]
    assert "checked against a full simulation" in record["simulation"]
    assert main(["bench", "--filter", "decode128", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "Simulated trace-only" in out
    assert "Simulator: pure Python (KERNELS_NEURON_SIM_COMPILED=0)." in out or compiled_sim.loaded()  # conftest.py
    (record,) = json.loads(out_json.read_text())["records"]
    assert record["simulation"] == "trace-only"


def test_trace_only_runs_of_the_suite_kernels_skip_the_engines_arithmetic(monkeypatch):
    """Every instruction the suite's kernels use skips its arithmetic in a trace-only run: none reads
    its operands' values as the engines do (``operands.rows``)."""
    from kernels_neuron.sim import operands

    def engine_arithmetic(t):
        raise AssertionError(f"a trace-only run computed with {t!r}")

    inputs = [case.make_inputs(0) for case in SMALL]  # a backward's inputs come from a full forward
    monkeypatch.setattr(operands, "rows", engine_arithmetic)
    for case, args in zip(SMALL, inputs):
        sim.run(case.kernel, *args, grid=case.grid, numerics=False, **case.kwargs)
    with pytest.raises(AssertionError, match="a trace-only run computed"):
        sim.run(SMALL[0].kernel, *inputs[0], **SMALL[0].kwargs)  # a full run does compute


def test_default_jobs_is_one_per_usable_cpu_at_most_eight(monkeypatch):
    from kernels_neuron.bench import runner

    monkeypatch.setattr(runner.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert bench.default_jobs() == runner.MAX_DEFAULT_JOBS == 8
    monkeypatch.setattr(runner.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert bench.default_jobs() == 2


@pytest.mark.parametrize("name", ["attention-decode/one-query-gqa", "attention-decode/paged"])
def test_the_decode_kernels_streaming_path_leaves_the_same_trace_on_stand_ins(name, monkeypatch):
    """At the reduced sizes every decode case's loads fit in SBUF at once (the resident path); the
    suite's batch-8 cases stream. Told that they do not fit, the small cases stream too."""
    import nki_src.attention_decode as decode

    case = _small(name)
    resident = sim.run(case.kernel, *case.make_inputs(0, values=False), numerics=False, **case.kwargs).trace
    monkeypatch.setattr(decode, "fits_resident", lambda *args: False)
    full = sim.run(case.kernel, *case.make_inputs(0), **case.kwargs).trace
    trace_only = sim.run(case.kernel, *case.make_inputs(0, values=False), numerics=False, **case.kwargs).trace
    assert bench.trace_difference(trace_only, full) is None
    assert bench.trace_difference(trace_only, resident) is not None  # the streaming path did run
