"""The bench simulates trace-only (``sim.run(..., numerics=False)``): for every suite case, at the
reduced sizes ``test_bench_references`` builds them (one per variant of each case, a test there checks
that every suite case is covered), the trace-only run leaves the same trace, instruction by
instruction, as a full simulation, and so the same modelled figures."""

import dataclasses
import json

import pytest
from test_bench_references import SMALL

from kernels_neuron import bench, cost, sim
from kernels_neuron.bench.calibration import fully_optimized
from kernels_neuron.cli import main

# fully_optimized's smallest shape is one 2048x1024x1024 block: seconds of arithmetic in full.
CASES = [pytest.param(c, marks=pytest.mark.slow) if c.kernel is fully_optimized else c for c in SMALL]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_trace_only_leaves_the_full_simulations_trace_and_modelled_figures(case):
    inputs = case.make_inputs(0)
    full = sim.run(case.kernel, *inputs, grid=case.grid, **case.kwargs)
    trace_only = sim.run(case.kernel, *inputs, grid=case.grid, numerics=False, **case.kwargs)
    assert full.numerics and not trace_only.numerics and trace_only.outputs is None
    assert len(trace_only.trace) > 0
    assert bench.trace_difference(trace_only.trace, full.trace) is None
    assert cost.estimate_trace(trace_only.trace, "trn2", flops=case.standard_flops) == cost.estimate_trace(
        full.trace, "trn2", flops=case.standard_flops
    )


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


def test_cli_says_which_simulation_ran(tmp_path, capsys):
    out_json = tmp_path / "b.json"
    assert main(["bench", "--filter", "decode128", "--check-numerics", "--json", str(out_json)]) == 0
    assert "traces are identical" in capsys.readouterr().out
    (record,) = json.loads(out_json.read_text())["records"]
    assert "checked against a full simulation" in record["simulation"]
    assert main(["bench", "--filter", "decode128", "--json", str(out_json)]) == 0
    assert "Simulated trace-only" in capsys.readouterr().out
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
