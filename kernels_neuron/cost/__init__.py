"""The Trainium cost model: a modelled (never measured) run time for a simulated kernel.

It list-schedules the simulator's instruction trace onto one NeuronCore's engines (TensorE,
VectorE, ScalarE, GpSimd and 16 DMA queues sharing the core's HBM bandwidth) with per-instruction
costs from AWS's published formulas, and compares the result with the roofline bound.

>>> import numpy as np
>>> from kernels_neuron import cost, sim
>>> _ = sim.install()
>>> from kernels_neuron.sim.examples import tiled_matmul
>>> report = cost.estimate(tiled_matmul, np.ones((256, 128), np.float32), np.ones((256, 512), np.float32))
>>> report.time_us >= report.roofline_us
True
>>> report.bound
'memory'
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from ..sim import run as _simulate
from ..sim.gc_pause import full_collections_paused
from ..sim.trace import Instruction, Trace
from .hardware import HARDWARE, Hardware, hardware
from .report import CostReport, CriticalStep
from .schedule import Schedule, schedule
from .timing import matmul_slowdown

__all__ = ["estimate", "estimate_trace", "CostReport", "CriticalStep", "Hardware", "HARDWARE", "hardware"]


def estimate(
    kernel: Callable[..., Any], *args: Any, target: str = "trn2", grid: Any = None, **kwargs: Any
) -> CostReport:
    """Simulate ``kernel(*args, **kwargs)`` and model its run time on ``target`` (trn1/trn2/trn3)."""
    result = _simulate(kernel, *args, target=target, grid=grid, **kwargs)
    return estimate_trace(result.trace, target)


@full_collections_paused()
def estimate_trace(trace: Trace, target: str | None = None, flops: int | None = None) -> CostReport:
    """Model an existing trace. SPMD programs, and the ranks of a multi-rank launch, each run on their own
    NeuronCore, in parallel.

    ``flops`` overrides the trace's FLOP count (every TensorE instruction, transposes included) for the
    TFLOPS and %-of-peak figures, e.g. with the standard count of the algorithm.
    """
    hw = hardware(target or trace.target)
    programs: dict[tuple[int, tuple[int, ...]], list[Instruction]] = defaultdict(list)
    for inst in trace.instructions:
        programs[(inst.rank, inst.program)].append(inst)
    if not programs:
        programs[(0, (0,))] = []
    schedules = {p: schedule(insts, hw) for p, insts in programs.items()}
    slowest = max(schedules, key=lambda p: schedules[p].makespan_ns)
    cores = len(programs)
    time_ns = schedules[slowest].makespan_ns
    flops = trace.flops if flops is None else flops
    compute_ns = max(_compute_bound_ns(insts, hw) for insts in programs.values())
    memory_ns = (
        max(sum(i.hbm_bytes_read + i.hbm_bytes_written for i in insts) for insts in programs.values())
        / hw.hbm_bytes_per_s
        * 1e9
    )
    busy: dict[str, float] = defaultdict(float)
    for s in schedules.values():
        for engine, ns in s.engine_busy_ns.items():
            busy[engine] += ns / 1e3 / cores
    seconds = time_ns / 1e9
    tflops = flops / seconds / 1e12 if seconds else 0.0
    hbm = trace.hbm_bytes
    hbm_gbps = hbm / seconds / 1e9 if seconds else 0.0
    return CostReport(
        target=hw.name,
        time_us=time_ns / 1e3,
        roofline_us=max(compute_ns, memory_ns) / 1e3,
        critical_path=_critical_steps(schedules[slowest], programs[slowest]),
        engine_busy_us=dict(sorted(busy.items())),
        flops=flops,
        tflops=tflops,
        pct_tensor_peak=100.0 * tflops * 1e12 / (hw.tensor_peak_flops * cores),
        hbm_bytes=hbm,
        hbm_gbps=hbm_gbps,
        pct_hbm_peak=100.0 * hbm_gbps * 1e9 / (hw.hbm_bytes_per_s * cores),
        sbuf_peak_bytes=trace.sbuf_peak_bytes,
        psum_peak_bytes=trace.psum_peak_bytes,
        instructions=len(trace.instructions),
        compute_bound_us=compute_ns / 1e3,
        memory_bound_us=memory_ns / 1e3,
        cores=cores,
    )


def _compute_bound_ns(instructions: list[Instruction], hw: Hardware) -> float:
    """TensorE time at peak rate for each matmul's dtype (fp32 at 1/4 rate, fp8 double-row at 2x)."""
    total = 0.0
    for inst in instructions:
        if inst.flops and inst.engine == "tensor":
            total += inst.flops * matmul_slowdown(inst.attrs) / hw.tensor_peak_flops
    return total * 1e9


def _critical_steps(sched: Schedule, instructions: list[Instruction]) -> list[CriticalStep]:
    return [
        CriticalStep(
            instructions[i].index,
            instructions[i].engine,
            instructions[i].op,
            sched.slots[i].start / 1e3,
            sched.slots[i].end / 1e3,
        )
        for i in sched.critical_path()
    ]
