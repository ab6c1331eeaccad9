"""The kernelize report: a row per module kernelize considered, and what became of it."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from ..ops._backend import FALLBACK_ATTRIBUTE


@dataclass(frozen=True)
class ReportRow:
    """One candidate module: where it is, which registry layer matched, and what happened at kernelize;
    ``call_time_fallback`` is why a swapped module last ran its own forward since (None if it never did)."""

    path: str
    layer: str
    kernel: str
    status: str  # "swapped" | "fallback" | "no kernel"
    reason: str = ""
    module: Any = field(default=None, repr=False, compare=False)  # a weakref.ref to the module

    @property
    def call_time_fallback(self) -> str | None:
        module = self.module() if self.module is not None else None
        return getattr(module, FALLBACK_ATTRIBUTE, None) if self.status == "swapped" else None


@dataclass
class KernelizeReport:
    """What ``kernelize`` did to each candidate module. Prints as a table."""

    device: str
    mode: str
    rows: list[ReportRow] = field(default_factory=list)

    @property
    def swapped(self) -> list[ReportRow]:
        return [r for r in self.rows if r.status == "swapped"]

    @property
    def fallbacks(self) -> list[ReportRow]:
        return [r for r in self.rows if r.status == "fallback"]

    @property
    def no_kernel(self) -> list[ReportRow]:
        """Modules of kinds the hub has no kernel for (LayerNorm, MoE experts, other MLPs, unrouted attention)."""
        return [r for r in self.rows if r.status == "no kernel"]

    @property
    def call_time_fallbacks(self) -> list[ReportRow]:
        """Swapped modules that have since run their own forward for a call the kernel could not serve."""
        return [r for r in self.rows if r.call_time_fallback is not None]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def table(self) -> Table:
        since = len(self.call_time_fallbacks)
        table = Table(
            title=f"kernels-neuron kernelize report (device={self.device}, mode={self.mode}): "
            f"{len(self.swapped)} swapped, {len(self.fallbacks)} kept their own forward"
            + (f", {len(self.no_kernel)} with no kernel" if self.no_kernel else "")
            + (f", {since} fell back at call time" if since else "")
            + ("" if self.rows else "; no module of a kind the hub has kernels for")
        )
        for column in ("module", "layer", "kernel", "status"):
            table.add_column(column, overflow="fold")
        for row in self.rows:
            status = {
                "swapped": "[green]swapped[/]",
                "fallback": f"[yellow]fallback[/]: {row.reason}",
                "no kernel": f"[dim]no kernel[/]: {row.reason}",
            }[row.status]
            if row.call_time_fallback is not None:
                status += f"; [yellow]fell back at call time[/]: {row.call_time_fallback}"
            table.add_row(row.path, row.layer, row.kernel, status)
        return table

    def __str__(self) -> str:
        text = io.StringIO()
        Console(width=160, file=text).print(self.table())
        return text.getvalue()
