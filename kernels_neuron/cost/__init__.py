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
from itertools import groupby
from operator import attrgetter
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
    programs: dict[tuple[int, tuple[int, ...]], list[Instruction]] = {}
    for key, run in groupby(trace.instructions, key=attrgetter("rank", "program")):
        programs.setdefault(key, []).extend(run)
    if not programs:
        programs[(0, (0,))] = []
    schedules = {p: schedule(insts, hw) for p, insts in programs.items()}
    makespans = {p: s.makespan_ns for p, s in schedules.items()}
    slowest = max(makespans, key=makespans.__getitem__)
    cores = len(programs)
    time_ns = makespans[slowest]
    traffic = {p: _traffic(insts, hw) for p, insts in programs.items()}
    if flops is None:
        flops = sum(program_flops for _, _, program_flops in traffic.values())
    compute_ns = max(compute for compute, _, _ in traffic.values())
    memory_ns = max(hbm_bytes for _, hbm_bytes, _ in traffic.values()) / hw.hbm_bytes_per_s * 1e9
    busy: dict[str, float] = defaultdict(float)
    for s in schedules.values():
        for engine, ns in s.engine_busy_ns.items():
            busy[engine] += ns / 1e3 / cores
    seconds = time_ns / 1e9
    tflops = flops / seconds / 1e12 if seconds else 0.0
    hbm = sum(hbm_bytes for _, hbm_bytes, _ in traffic.values())
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


def _traffic(instructions: list[Instruction], hw: Hardware) -> tuple[float, int, int]:
    """One program's compute bound in ns (TensorE time at peak rate for each matmul's dtype: fp32 at
    1/4 rate, fp8 double-row at 2x), its HBM bytes read and written, and its TensorE FLOPs."""
    peak = hw.tensor_peak_flops
    compute = 0.0
    hbm_bytes = flops = 0
    for inst in instructions:
        hbm_bytes += inst.hbm_bytes_read + inst.hbm_bytes_written
        if inst.flops:
            flops += inst.flops
            if inst.engine == "tensor":
                compute += inst.flops * matmul_slowdown(inst.attrs) / peak
    return compute * 1e9, hbm_bytes, flops


def _critical_steps(sched: Schedule, instructions: list[Instruction]) -> list[CriticalStep]:
    starts, ends = sched.starts, sched.ends
    steps = []
    for i in sched.critical_path():
        inst = instructions[i]
        steps.append(CriticalStep(inst.index, inst.engine, inst.op, starts[i] / 1e3, ends[i] / 1e3))
    return steps
