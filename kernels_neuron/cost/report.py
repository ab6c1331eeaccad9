"""What the cost model reports about a kernel, and how it prints. Every figure is modelled."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import NamedTuple

from rich.console import Console
from rich.table import Table

MODELLED = "modelled"


class CriticalStep(NamedTuple):
    """One instruction on the critical path, with its modelled start and end (µs).

    A named tuple rather than a frozen dataclass: a TensorE-bound kernel's critical path holds most of
    its instructions, and a tuple is built four times faster."""

    index: int  # type: ignore[assignment]  # the field hides tuple.index(), which a step has no use for
    engine: str
    op: str
    start_us: float
    end_us: float


@dataclass
class CostReport:
    """A modelled (estimated, never measured) run time of a kernel on one target.

    ``time_us`` is the list-scheduled finish time; ``roofline_us`` the lower bound
    max(compute-bound, bandwidth-bound); ``critical_path`` the chain of instructions that
    finishes last; ``engine_busy_us`` per-engine busy time (``dma`` counts HBM bandwidth time).
    """

    target: str
    time_us: float
    roofline_us: float
    critical_path: list[CriticalStep]
    engine_busy_us: dict[str, float]
    flops: int
    tflops: float
    pct_tensor_peak: float
    hbm_bytes: int
    hbm_gbps: float
    pct_hbm_peak: float
    sbuf_peak_bytes: int
    psum_peak_bytes: int
    instructions: int
    compute_bound_us: float
    memory_bound_us: float
    cores: int = 1

    @property
    def bound(self) -> str:
        """Which roof is lower-bounding the kernel: "compute" or "memory"."""
        return "compute" if self.compute_bound_us >= self.memory_bound_us else "memory"

    @property
    def pct_of_roofline(self) -> float:
        """How close the modelled time is to the roofline bound (100 = at the roof)."""
        return 100.0 * self.roofline_us / self.time_us if self.time_us else 0.0

    def engine_utilisation(self) -> dict[str, float]:
        """Busy share of the modelled run time per engine, in percent."""
        return {e: 100.0 * busy / self.time_us if self.time_us else 0.0 for e, busy in self.engine_busy_us.items()}

    def critical_path_summary(self) -> str:
        """Share of the critical path's time owed to each engine, e.g. ``dma 62%, tensor 38%``.

        Each step is charged the time from the previous step's end to its own end (a step's span
        may overlap the one it waited for)."""
        total: dict[str, float] = {}
        previous_end = 0.0
        for step in self.critical_path:
            total[step.engine] = total.get(step.engine, 0.0) + max(0.0, step.end_us - previous_end)
            previous_end = max(previous_end, step.end_us)
        whole = sum(total.values()) or 1.0
        return ", ".join(f"{e} {100 * t / whole:.0f}%" for e, t in sorted(total.items(), key=lambda kv: -kv[1]))

    def table(self, title: str | None = None) -> Table:
        label = f"{MODELLED} ({self.target.capitalize()} estimate)"
        table = Table(title=title or f"cost model: {label}, not a measurement", show_header=True)
        table.add_column("figure")
        table.add_column(label, justify="right")
        rows = [
            ("time", f"{self.time_us:,.2f} µs"),
            (
                "roofline bound",
                f"{self.roofline_us:,.2f} µs ({self.bound}-bound; {self.pct_of_roofline:.0f}% of roofline)",
            ),
            ("TensorE", f"{self.flops:,} FLOP · {self.tflops:.2f} TFLOPS · {self.pct_tensor_peak:.1f}% of peak"),
            ("HBM", f"{self.hbm_bytes:,} B · {self.hbm_gbps:.1f} GB/s · {self.pct_hbm_peak:.1f}% of bandwidth"),
            (
                "engine busy",
                ", ".join(
                    f"{e} {t:,.2f} µs ({u:.0f}%)"
                    for (e, t), u in zip(self.engine_busy_us.items(), self.engine_utilisation().values())
                ),
            ),
            ("critical path", f"{len(self.critical_path)} instructions: {self.critical_path_summary()}"),
            ("peak SBUF / PSUM", f"{self.sbuf_peak_bytes:,} / {self.psum_peak_bytes:,} B per partition"),
            ("instructions", f"{self.instructions:,}" + (f" on {self.cores} NeuronCores" if self.cores > 1 else "")),
        ]
        for name, value in rows:
            table.add_row(name, value)
        return table

    def __str__(self) -> str:
        buffer = io.StringIO()
        Console(width=120, file=buffer).print(self.table())
        return buffer.getvalue()
