"""Benchmark output: a rich table, a JSON file and a roofline plot. Modelled figures say so."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from ..cost.hardware import hardware
from .case import Record

JSON_SCHEMA_VERSION = 1


def _shape(record: Record) -> str:
    return " ".join(f"{k}={v}" for k, v in record.shape.items())


def render_table(records: Sequence[Record]) -> Table:
    """One row per case; modelled columns are labelled as Trn estimates, measured ones as device times."""
    target = records[0].target.capitalize() if records else "Trn2"
    measured = any(r.measured_us is not None for r in records)
    table = Table(title=f"kernels-neuron microbenchmarks — modelled = cost-model estimate for {target}, not measured")
    table.add_column("case", no_wrap=True)
    for column in ("model", "shape", "dtype"):
        table.add_column(column, overflow="fold")
    for column in (
        f"modelled µs ({target})",
        "roofline µs (bound)",
        "% of roofline",
        "TFLOPS (% peak)",
        "GB/s (% HBM BW)",
        "sim wall s",
    ):
        table.add_column(column, justify="right", overflow="fold")
    table.add_column("replaces", overflow="fold")
    if measured:
        table.add_column("measured µs (device)", justify="right")
        table.add_column("reference measured µs", justify="right")
    for r in records:
        row = [
            r.name,
            r.model,
            _shape(r),
            r.dtype,
            f"{r.modelled_us:,.1f}",
            f"{r.roofline_us:,.1f} ({r.bound})",
            f"{r.pct_of_roofline:.0f}%",
            f"{r.tflops:.1f} ({r.pct_tensor_peak:.1f}%)",
            f"{r.hbm_gbps:.0f} ({r.pct_hbm_peak:.1f}%)",
            f"{r.sim_wall_s:.2f}",
            r.reference,
        ]
        if measured:
            row += [_maybe(r.measured_us), _maybe(r.reference_measured_us)]
        table.add_row(*row)
    return table


def _maybe(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def write_json(records: Sequence[Record], path: str | Path) -> None:
    """One record per case; ``modelled_*`` fields are cost-model estimates, ``measured_*`` device times."""
    payload = {
        "schema_version": JSON_SCHEMA_VERSION,
        "note": "modelled_* figures are kernels-neuron cost-model estimates, not measurements; "
        "measured_* are device timings and null where no Trainium was present",
        "records": [r.as_dict() for r in records],
    }
    Path(path).write_text(json.dumps(payload, indent=2))


def plot_roofline(records: Sequence[Record], path: str | Path) -> None:
    """Roofline of the target (left) with each case's modelled performance, and % of roofline (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not records:
        raise ValueError("nothing to plot: no benchmark records")
    hw = hardware(records[0].target)
    peak_tflops = hw.tensor_peak_flops / 1e12
    bandwidth = hw.hbm_bytes_per_s
    # Tall enough for one readable bar label per case; the points are numbered, the bars name them.
    height = max(5.5, 0.2 * len(records) + 1.5)
    fig, (roof, share) = plt.subplots(1, 2, figsize=(14, height), gridspec_kw={"width_ratios": [3, 2]})
    intensity = np.logspace(-1, 4, 200)
    roof.loglog(
        intensity,
        np.minimum(peak_tflops, intensity * bandwidth / 1e12),
        color="black",
        lw=2,
        label=f"{hw.name} roof: {peak_tflops:.1f} TFLOPS bf16, {bandwidth / 1e9:.0f} GB/s HBM per core",
    )
    ridge = hw.tensor_peak_flops / bandwidth
    roof.axvline(ridge, color="grey", ls=":", lw=1)
    roof.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_tflops / 30), rotation=90, color="grey", fontsize=8)
    markers = "osD^vP*Xh<>p"
    for i, r in enumerate(records):
        if r.flops and r.hbm_bytes:
            point = (r.flops / r.hbm_bytes, r.tflops)
            roof.scatter([point[0]], [point[1]], s=40, zorder=3, marker=markers[i % len(markers)])
            roof.annotate(str(i + 1), point, xytext=(3, 3), textcoords="offset points", fontsize=7)
    roof.set_xlabel("arithmetic intensity (FLOP per HBM byte)")
    roof.set_ylabel("TFLOPS (modelled)")
    roof.set_title(f"Roofline, {hw.name} — modelled, not measured")
    roof.grid(True, which="both", alpha=0.3)
    roof.legend(fontsize=7, loc="upper left")
    labels = [f"{i + 1}. {r.name}" for i, r in enumerate(records)]
    colors = ["tab:blue" if r.bound == "compute" else "tab:orange" for r in records]
    share.barh(labels, [r.pct_of_roofline for r in records], color=colors)
    share.axvline(100, color="black", lw=1)
    share.set_xlim(0, 105)
    share.set_xlabel("% of roofline bound (modelled)")
    share.set_title("blue: compute-bound · orange: memory-bound", fontsize=9)
    share.tick_params(axis="y", labelsize=7)
    share.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
